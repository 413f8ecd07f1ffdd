// AdamW over flat fp32 state in one pass (CUDA build only): the optimizer's moments and master
// copy read once and, on commit, written once, where the ATen composition makes a dozen passes
// and a staged copy of each buffer.
#ifndef LORASTEP_LIB_KERNELS_ADAMW_FLAT_H_
#define LORASTEP_LIB_KERNELS_ADAMW_FLAT_H_

#include <cstdint>

namespace lorastep {
namespace kernels {

// The gradient as consecutive device buffers (the adapter's grad buckets end to end): element
// i of the flat gradient lies in the first part whose `ends` exceeds i.
struct FlatParts {
  static constexpr int kMaxParts = 8;
  const float* data[kMaxParts] = {};
  int64_t ends[kMaxParts] = {};
  int count = 0;
};

// One step's scalars (fp32, as PyTorch applies double scalars to fp32 tensors).
struct AdamWScalars {
  float beta1 = 0, beta2 = 0;
  float grad_weight = 0;     // (1 - beta1) * clip
  float square_weight = 0;   // (1 - beta2) * clip^2
  float sqrt_bc2 = 1, eps = 0;
  float decay = 1;           // 1 - lr * weight_decay
  float step = 0;            // -lr / bc1
};

// For each i < n: m' = beta1 m + grad_weight g, v' = beta2 v + square_weight g^2,
// master' = decay master + step m' / (sqrt(v') / sqrt_bc2 + eps). `write` false: nothing is
// written but *largest (a device fp32 the caller zeroed) becomes the largest |master'| (NaN
// when one is NaN); true: m, v and master take the new values (largest may be null). The same
// inputs give the same bits either way, so a checked update is the one committed. Returns a
// CUDA error string, or nullptr.
const char* LaunchAdamWFlat(const FlatParts& grad, float* m, float* v, float* master, int64_t n,
                            const AdamWScalars& s, bool write, float* largest, void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_ADAMW_FLAT_H_
