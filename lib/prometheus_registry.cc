#include "lib/prometheus_registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace lorastep {
namespace {

std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string LabelText(const PrometheusRegistry::Labels& labels, const std::string& extra = "") {
  std::string out;
  for (const auto& [k, v] : labels) {
    out += out.empty() ? "" : ",";
    out += k + "=\"" + Escape(v) + "\"";
  }
  if (!extra.empty()) out += (out.empty() ? "" : ",") + extra;
  return out.empty() ? "" : "{" + out + "}";
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

const char* TypeName(PrometheusRegistry::Type t) {
  switch (t) {
    case PrometheusRegistry::Type::kCounter: return "counter";
    case PrometheusRegistry::Type::kGauge: return "gauge";
    case PrometheusRegistry::Type::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

std::vector<double> PrometheusRegistry::SecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}

void PrometheusRegistry::Declare(const std::string& name, Type type, const std::string& help,
                                 std::vector<double> buckets) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = families_[name];
  f.type = type;
  f.help = help;
  std::sort(buckets.begin(), buckets.end());
  f.buckets = std::move(buckets);
}

PrometheusRegistry::Series* PrometheusRegistry::Find(const std::string& name, const Labels& labels,
                                                     Type type) {
  auto it = families_.find(name);
  if (it == families_.end() || it->second.type != type) return nullptr;
  Series& s = it->second.series[LabelText(labels)];
  if (s.labels.empty()) s.labels = labels;
  if (type == Type::kHistogram && s.counts.empty()) s.counts.assign(it->second.buckets.size() + 1, 0);
  return &s;
}

void PrometheusRegistry::Add(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = Find(name, labels, Type::kCounter)) s->value += value;
}

void PrometheusRegistry::Set(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = Find(name, labels, Type::kGauge)) s->value = value;
}

void PrometheusRegistry::Observe(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  Series* s = Find(name, labels, Type::kHistogram);
  if (s == nullptr) return;
  const std::vector<double>& b = families_.at(name).buckets;
  const size_t i = std::lower_bound(b.begin(), b.end(), value) - b.begin();  // first bound >= value
  ++s->counts[i];
  s->sum += value;
  ++s->count;
}

void PrometheusRegistry::RemoveSeries(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, f] : families_) {
    for (auto it = f.series.begin(); it != f.series.end();) {
      const bool match = std::any_of(it->second.labels.begin(), it->second.labels.end(),
                                     [&](const auto& kv) { return kv.first == key && kv.second == value; });
      it = match ? f.series.erase(it) : std::next(it);
    }
  }
}

std::string PrometheusRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " " + f.help + "\n# TYPE " + name + " " + TypeName(f.type) + "\n";
    for (const auto& [key, s] : f.series) {
      if (f.type != Type::kHistogram) {
        out += name + key + " " + Number(s.value) + "\n";
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i <= f.buckets.size(); ++i) {
        cumulative += s.counts[i];
        const std::string le = i < f.buckets.size() ? Number(f.buckets[i]) : "+Inf";
        out += name + "_bucket" + LabelText(s.labels, "le=\"" + le + "\"") + " " + std::to_string(cumulative) + "\n";
      }
      out += name + "_sum" + key + " " + Number(s.sum) + "\n";
      out += name + "_count" + key + " " + std::to_string(s.count) + "\n";
    }
  }
  return out;
}

}  // namespace lorastep
