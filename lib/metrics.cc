#include "lib/metrics.h"

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
  for (const auto& [name, a] : other.values_) {
    Accumulator& mine = values_[name];
    mine.sum += a.sum;
    mine.count += a.count;
    mine.max = std::max(mine.max, a.max);
  }
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

}  // namespace lorastep
