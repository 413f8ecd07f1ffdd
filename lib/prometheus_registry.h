// Counters, gauges and histograms with labels, rendered in the Prometheus text exposition
// format (version 0.0.4). Debian 12 ships no prometheus-cpp; this is the part of it lorastep
// needs. Thread-safe. The coordinator and the worker record into one each; an HTTP endpoint
// (rpc/metrics_http_server.h) serves Render().
#ifndef LORASTEP_LIB_PROMETHEUS_REGISTRY_H_
#define LORASTEP_LIB_PROMETHEUS_REGISTRY_H_

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace lorastep {

class PrometheusRegistry {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;
  enum class Type { kCounter, kGauge, kHistogram };

  // Declares a metric family; recording into an undeclared name is a programming error
  // (ignored). `buckets`: upper bounds of a histogram, ascending (+Inf is added).
  void Declare(const std::string& name, Type type, const std::string& help,
               std::vector<double> buckets = {});
  void Add(const std::string& name, const Labels& labels, double value = 1.0);  // counter
  void Set(const std::string& name, const Labels& labels, double value);        // gauge
  void Observe(const std::string& name, const Labels& labels, double value);    // histogram
  // Drops every series with label `key` = `value` (a deleted run).
  void RemoveSeries(const std::string& key, const std::string& value);
  std::string Render() const;

  // Default buckets for durations in seconds: 1 ms to 10 min.
  static std::vector<double> SecondsBuckets();

 private:
  struct Series {
    Labels labels;
    double value = 0;                 // counter, gauge
    std::vector<uint64_t> counts;     // histogram: per bucket (not cumulative), +Inf last
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> buckets;
    std::map<std::string, Series> series;  // by rendered label set
  };
  Series* Find(const std::string& name, const Labels& labels, Type type);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_PROMETHEUS_REGISTRY_H_
