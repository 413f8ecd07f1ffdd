// Whether lorastep's fused CUDA kernels (lib/kernels/fused_layer.h) serve a layer's
// element-wise pieces: RMSNorm (and Qwen3.5's gated form), SwiGLU and RoPE.
#ifndef LORASTEP_LIB_MODEL_FUSED_KERNELS_H_
#define LORASTEP_LIB_MODEL_FUSED_KERNELS_H_

#include <ATen/ATen.h>

namespace lorastep {

// True for CUDA tensors x and other of one float type in a build with the kernels; elsewhere
// the pieces are ATen compositions with the same rounding. LORASTEP_FUSED_KERNELS=0 turns the
// kernels off (for side-by-side benchmarks).
bool UseFusedKernels(const at::Tensor& x, const at::Tensor& other);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_FUSED_KERNELS_H_
