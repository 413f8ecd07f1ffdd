// The element-wise pieces of a decoder layer, each one autograd node: SwiGLU, RoPE, RMSNorm
// (with the residual add before it) and LoRA dropout. On CUDA they run as lorastep's fused
// kernels (lib/kernels/fused_layer.h) where UseFusedKernels says so.
#ifndef LORASTEP_LIB_MODEL_LAYER_OPS_H_
#define LORASTEP_LIB_MODEL_LAYER_OPS_H_

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "lib/model/fused_kernels.h"
#include "lib/model/linear.h"

namespace lorastep {

// silu(gate) * up.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);
// gate_up [.., 2f]: the gate half, then the up half.
at::Tensor SwiGluPacked(const at::Tensor& gate_up);
// gpt-oss's experts over gate_up [.., 2f] (gate half, then up half): with g = min(gate, limit)
// and u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g), in the input's dtype
// (as transformers computes it); ATen operations, so autograd gives the gradient.
// It runs as ClampedSwiGluKernel where that is defined, unless LORASTEP_FUSED_CLAMPED_SWIGLU=0
// (the composition, for a side-by-side timing).
at::Tensor ClampedSwiGluPacked(const at::Tensor& gate_up, double alpha, double limit);
// The same as one CUDA kernel each way (lib/kernels/fused_layer.h) with the composition's
// rounding, where UseFusedKernels holds; undefined elsewhere.
at::Tensor ClampedSwiGluKernel(const at::Tensor& gate_up, double alpha, double limit);
// down_proj's input as a RecomputedInput of a packed gate_up (see its definition).
extern const RecomputedInput kSwiGluOfPacked;

// Rotary embedding of x [b, s, heads, d] with cos/sin tables [s, d].
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
#ifdef LORASTEP_WITH_CUDA_KERNELS
// (RoPE(q), RoPE(k), v) from one packed projection qkv [b, s, (heads + 2 kv_heads) d], read
// in place; backward writes one packed gradient. CUDA tensors with unit stride along d.
std::vector<at::Tensor> QkvRope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                int64_t kv_heads);
#endif

// Inverted dropout drawing from `generator` (null: the global one).
at::Tensor LoraDropout(const at::Tensor& x, double p, at::Generator* generator);

// Hugging Face's Qwen2RMSNorm: normalize in fp32, cast back, then scale. With `room` > 0 the
// result is the left block of a buffer `room` columns wider, which the next projection may
// write (LoraLinearGroup's input_has_room).
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t room = 0);
// (x + y, RmsNorm(x + y)) as one autograd node (the residual add before a norm; see
// AddRmsNormFunction); with y undefined, (x, RmsNorm(x)).
std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                             double eps, int64_t room = 0);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LAYER_OPS_H_
