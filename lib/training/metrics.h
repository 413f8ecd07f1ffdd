// Step metrics named `name:reduction` ("loss:sum", "pg_clipfrac:mean"). Each holds a sum and a
// count so partial results from micro-batches (and later ranks) merge exactly:
// ":sum" reports the sum, ":mean" sum / count, ":max" the largest value seen.
#ifndef LORASTEP_LIB_TRAINING_METRICS_H_
#define LORASTEP_LIB_TRAINING_METRICS_H_

#include <map>
#include <string>
#include <vector>

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
  const std::map<std::string, Accumulator>& accumulators() const { return values_; }
  // Merges one partial (as Merge does for each of another Metrics' entries).
  void AddAccumulator(const std::string& name, const Accumulator& partial);

 private:
  std::map<std::string, Accumulator> values_;
};

// Merges the metrics of the ranks of a mesh into the step's metrics:
//  - data metrics (losses, token counts, means, FLOPs, throughput) from the reporting ranks
//    only -- one per data-parallel replica (tensor rank 0 of the last stage) -- as sums and
//    counts, so a replica's tensor and pipeline ranks are counted once;
//  - time_* (phase times): the slowest rank (the step waits for it);
//  - grad_norm / lr: identical on every rank, taken from `per_rank[0]`;
//  - mfu: summed over the reporting replicas and divided by the world size;
//  - :max metrics (peak memory): the largest over every rank.
Metrics MergeRankMetrics(const std::vector<Metrics>& per_rank, const std::vector<bool>& reporting);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_METRICS_H_
