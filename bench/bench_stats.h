// Small helpers the service benchmark clients share: a nearest-rank quantile and the steady
// clock in nanoseconds (one clock for every process of a host, so several processes' times
// line up).
#ifndef LORASTEP_BENCH_BENCH_STATS_H_
#define LORASTEP_BENCH_BENCH_STATS_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace lorastep {

// The value at quantile `q` (0..1) of `v`, nearest rank; 0 for none.
inline double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5))];
}

inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_BENCH_STATS_H_
