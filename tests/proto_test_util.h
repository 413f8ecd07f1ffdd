// Test data in the API's protobuf form, shared by the service and mesh tests.
#ifndef LORASTEP_TESTS_PROTO_TEST_UTIL_H_
#define LORASTEP_TESTS_PROTO_TEST_UTIL_H_

#include <cstdint>

#include "lorastep/v1/trainer.pb.h"

namespace lorastep {
namespace testing {

// An RL datum of n positions, deterministic in (i, step): sampler log-probs, advantages
// +1 (even i) or -0.5 (odd i), the first two positions masked out.
inline v1::Datum RlDatum(int i, int step, int n, int64_t vocab) {
  v1::Datum d;
  for (int j = 0; j < n; ++j) {
    d.add_tokens((i * 7 + j * 3 + step) % vocab);
    d.add_target_tokens((i * 5 + j * 11 + step) % vocab);
    d.add_logprobs(-4.0f - 0.1f * j);
    d.add_advantages(j < 2 ? 0.0f : (i % 2 == 0 ? 1.0f : -0.5f));
  }
  return d;
}

}  // namespace testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_PROTO_TEST_UTIL_H_
