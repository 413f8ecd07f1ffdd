// Qwen3.5's short causal depthwise convolution with SiLU as one CUDA kernel each way (CUDA
// build only). As an ATen composition it is a padded cuDNN depthwise convolution, a SiLU and
// their layout copies and casts, each way. The kernels compute in fp32 and round to the
// storage type where the composition stores a tensor, so both paths round alike (the taps
// may add in another order).
//
// All tensors are contiguous, of `type`; every function runs on `stream` (a cudaStream_t)
// and returns a CUDA error string, or nullptr.
#ifndef LORASTEP_LIB_KERNELS_CAUSAL_CONV_H_
#define LORASTEP_LIB_KERNELS_CAUSAL_CONV_H_

#include <cstdint>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

// The most taps the kernels take (Qwen3.5's convolution has 4).
inline constexpr int kMaxConvTaps = 8;

// x, y: `sequences` sequences of `length` rows each, back to back, rows of `channels`;
// weight: channels x taps. For row t of a sequence starting at row s:
//   u = (sum over j with t - taps + 1 + j >= s of weight[c, j] x[t - taps + 1 + j, c]).to(type),
//   y[t, c] = silu(u).to(type).
const char* LaunchCausalConvSilu(const void* x, const void* weight, ElementType type, int64_t sequences,
                                 int64_t length, int64_t channels, int taps, void* y, void* stream);

// The input gradient of LaunchCausalConvSilu's y (the weight's is not computed): with u formed
// again from x, gu[t, c] = (grad_y[t, c] silu'(u[t, c])).to(type) and
//   grad_x[t, c] = (sum over j with t + taps - 1 - j in t's sequence of weight[c, j] gu[t + taps - 1 - j, c]).to(type).
const char* LaunchCausalConvSiluGrad(const void* grad_y, const void* x, const void* weight, ElementType type,
                                     int64_t sequences, int64_t length, int64_t channels, int taps, void* grad_x,
                                     void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_CAUSAL_CONV_H_
