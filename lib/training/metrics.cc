#include "lib/training/metrics.h"

#include <algorithm>

#include "absl/strings/match.h"

namespace lorastep {

void Metrics::Add(const std::string& name, double sum, double count) {
  Accumulator& a = values_[name];
  a.sum += sum;
  a.count += count;
  a.max = std::max(a.max, sum);
}

void Metrics::Set(const std::string& name, double value) {
  values_[name] = Accumulator{value, 1.0, value};
}

void Metrics::Merge(const Metrics& other) {
  for (const auto& [name, a] : other.values_) AddAccumulator(name, a);
}

void Metrics::AddAccumulator(const std::string& name, const Accumulator& a) {
  Accumulator& mine = values_[name];
  mine.sum += a.sum;
  mine.count += a.count;
  mine.max = std::max(mine.max, a.max);
}

double Metrics::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return 0.0;
  const Accumulator& a = it->second;
  if (absl::EndsWith(name, ":mean")) return a.count > 0 ? a.sum / a.count : 0.0;
  if (absl::EndsWith(name, ":max")) return a.max;
  return a.sum;
}

std::map<std::string, double> Metrics::Reduced() const {
  std::map<std::string, double> out;
  for (const auto& [name, a] : values_) out[name] = Get(name);
  return out;
}

Metrics MergeRankMetrics(const std::vector<Metrics>& per_rank, const std::vector<bool>& reporting) {
  Metrics out;
  if (per_rank.empty()) return out;
  const double world = static_cast<double>(per_rank.size());
  std::map<std::string, double> slowest;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    for (const auto& [name, a] : per_rank[r].accumulators()) {
      if (absl::StartsWith(name, "time_")) {
        auto it = slowest.find(name);
        const double v = per_rank[r].Get(name);
        if (it == slowest.end() || v > it->second) slowest[name] = v;
      } else if (name == "grad_norm:sum" || name == "lr:sum") {
        if (r == 0) out.AddAccumulator(name, a);
      } else if (absl::EndsWith(name, ":max")) {
        out.AddAccumulator(name, a);
      } else if (reporting[r]) {
        Metrics::Accumulator part = a;
        if (name == "mfu:sum") part.sum /= world;
        out.AddAccumulator(name, part);
      }
    }
  }
  for (const auto& [name, v] : slowest) out.Set(name, v);
  return out;
}

}  // namespace lorastep
