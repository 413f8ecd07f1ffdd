// Step metrics named `name:reduction` ("loss:sum", "pg_clipfrac:mean"). Each holds a sum and a
// count so partial results from micro-batches (and later ranks) merge exactly:
// ":sum" reports the sum, ":mean" sum / count, ":max" the largest value seen.
#ifndef LORASTEP_LIB_METRICS_H_
#define LORASTEP_LIB_METRICS_H_

#include <map>
#include <string>

namespace lorastep {

class Metrics {
 public:
  struct Accumulator {
    double sum = 0.0;
    double count = 0.0;
    double max = -1e300;
  };

  // Adds a partial: for ":mean" metrics `sum` over `count` items; for others count is ignored.
  void Add(const std::string& name, double sum, double count = 1.0);
  // Replaces a value (timings, learning rate, counters set once per step).
  void Set(const std::string& name, double value);
  void Merge(const Metrics& other);
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // The reduced value; 0 for an absent metric or a mean over nothing.
  double Get(const std::string& name) const;
  // Every metric's reduced value, sorted by name.
  std::map<std::string, double> Reduced() const;

 private:
  std::map<std::string, Accumulator> values_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_METRICS_H_
