// The sample requests the sampler benchmarks send: temperature 1, nothing cut, no stop.
#ifndef LORASTEP_BENCH_SAMPLE_REQUESTS_H_
#define LORASTEP_BENCH_SAMPLE_REQUESTS_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "lib/sampling/sampler.h"

namespace lorastep {

inline SampleRequest TemperatureOneRequest(std::vector<int64_t> prompt, int64_t samples, int64_t max_tokens,
                                           uint64_t seed) {
  SampleRequest r;
  r.prompt = std::move(prompt);
  r.num_samples = samples;
  r.params.max_tokens = max_tokens;
  r.params.temperature = 1.0;
  r.params.seed = seed;
  return r;
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_SAMPLE_REQUESTS_H_
