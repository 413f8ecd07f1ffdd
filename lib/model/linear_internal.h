// Pieces lib/model/linear.cc and lib/model/segmented_lora.cc share; not for other users.
#ifndef LORASTEP_LIB_MODEL_LINEAR_INTERNAL_H_
#define LORASTEP_LIB_MODEL_LINEAR_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace lorastep {
namespace linear_internal {

// t's shape with its last dimension replaced.
std::vector<int64_t> ShapeWithLastDim(const at::Tensor& t, int64_t last);

// A leaf that requires grad, one per device, that the LoRA functions take in place of their
// factors on the fused path (one AccumulateGrad edge instead of one per factor).
const at::Tensor& GradAnchor(const at::Device& device);

// left @ right + (bias) + alpha * (low @ low_right) for a small inner size of `low` (a LoRA
// rank), the GEMMs ordered so the large one keeps its write-only epilogue where it can.
at::Tensor LargeGemmOverLowRank(const at::Tensor& left, const at::Tensor& right, const at::Tensor& bias,
                                const at::Tensor& low, const at::Tensor& low_right, double alpha);

}  // namespace linear_internal
}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LINEAR_INTERNAL_H_
