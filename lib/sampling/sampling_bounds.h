// The sampler's bounds on a request, without LibTorch: the fronts that check a request before
// it reaches a worker (the Tinker front) name their own fields with the same limits.
#ifndef LORASTEP_LIB_SAMPLING_SAMPLING_BOUNDS_H_
#define LORASTEP_LIB_SAMPLING_SAMPLING_BOUNDS_H_

#include <cstdint>

namespace lorastep {

// The most samples one prompt may ask for, and the most top log-probs per position.
inline constexpr int64_t kMaxSamplesPerPrompt = 256;
inline constexpr int64_t kMaxTopLogprobs = 64;

}  // namespace lorastep

#endif  // LORASTEP_LIB_SAMPLING_SAMPLING_BOUNDS_H_
