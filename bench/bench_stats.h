// Small helpers the benchmarks share: a nearest-rank quantile, the steady clock in
// nanoseconds (one clock for every process of a host, so several processes' times line up)
// and the date a result file records.
#ifndef LORASTEP_BENCH_BENCH_STATS_H_
#define LORASTEP_BENCH_BENCH_STATS_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <string>
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

// Now, UTC, as "2026-12-06T05:06:55Z" (a result file's date).
inline std::string UtcNowIso() {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_BENCH_STATS_H_
