// A decoder layer's memory-bound steps as one kernel each way (CUDA build only): RMSNorm (and
// Qwen3.5's gated form), SwiGLU (and gpt-oss's clamped form) and rotary embeddings. As ATen
// compositions each is several kernels with fp32 temporaries written and read back, most of a
// LoRA step's copy/cast time (docs/PERFORMANCE.md, the 7B step). Each kernel computes in fp32
// and rounds to the storage type wherever the ATen composition stores a tensor, so both paths
// round alike (the RMSNorm row sums may add in another order).
//
// All tensors are contiguous, of `type`, unless said otherwise; every function runs on
// `stream` (a cudaStream_t) and returns a CUDA error string, or nullptr.
#ifndef LORASTEP_LIB_KERNELS_FUSED_LAYER_H_
#define LORASTEP_LIB_KERNELS_FUSED_LAYER_H_

#include <cstdint>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

// y = weight * (x * rstd).to(type), rstd = rsqrt(mean(x^2) + eps) per row, in fp32.
// x: rows x hidden; y: rows of hidden elements, `y_ld` (>= hidden) apart; weight: hidden;
// rstd: fp32 rows (saved for backward). With `residual` (rows x hidden) non-null, x + residual
// (rounded to type) takes x's place and is written to `sum`: the residual add before a norm,
// in the same pass.
const char* LaunchRmsNorm(const void* x, const void* residual, const void* weight, ElementType type, int64_t rows,
                          int64_t hidden, float eps, void* sum, void* y, int64_t y_ld, float* rstd, void* stream);

// The input gradient of LaunchRmsNorm's y:
//   gn = (g * weight).to(type), n = x * rstd, dx = (gn - n * mean(gn * n)) * rstd,
// plus residual_grad (rows x hidden, rounded once more) when non-null: x's gradient along
// the residual stream, added in the same pass.
const char* LaunchRmsNormGrad(const void* grad_y, const void* x, const void* weight,
                              const float* rstd, const void* residual_grad, ElementType type, int64_t rows,
                              int64_t hidden, void* grad_x, void* stream);

// Qwen3.5's gated norm, y = ((weight * (x * rstd).to(type)) * silu(z)).to(type) with the gate
// and the product in fp32; x, z, y: rows x hidden; rstd as LaunchRmsNorm's.
const char* LaunchGatedRmsNorm(const void* x, const void* z, const void* weight, ElementType type, int64_t rows,
                               int64_t hidden, float eps, void* y, float* rstd, void* stream);

// The input gradients of LaunchGatedRmsNorm's y for x and z (the weight's is not computed).
const char* LaunchGatedRmsNormGrad(const void* grad_y, const void* x, const void* z, const void* weight,
                                   const float* rstd, ElementType type, int64_t rows, int64_t hidden, void* grad_x,
                                   void* grad_z, void* stream);

// out = silu(gate).to(type) * up over rows x f: gate and up rows `in_ld` elements apart (the
// two halves of one [rows, 2f] projection: up = gate + f, in_ld = 2f); out contiguous.
const char* LaunchSwiGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f,
                         int64_t in_ld, void* out, void* stream);

// grad_gate = silu'(gate) * (g * up).to(type), grad_up = g * silu(gate).to(type), for a
// contiguous g (rows x f); the gradients' rows are `out_ld` elements apart. When `act` is
// non-null it also receives LaunchSwiGlu's output (contiguous, the same bits): backward
// recomputes the activation instead of keeping it from forward.
const char* LaunchSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type,
                             int64_t rows, int64_t f, int64_t in_ld, int64_t out_ld, void* grad_gate,
                             void* grad_up, void* act, void* stream);

// gpt-oss's clamped SwiGLU, out = ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)).to(type)
// with g = min(gate, limit), rounded to type after each operation as the ATen composition
// stores it; layout as LaunchSwiGlu's.
const char* LaunchClampedSwiGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f,
                                int64_t in_ld, float alpha, float limit, void* out, void* stream);

// Its gradients for gate and up (zero where a clamp held the input), as autograd through that
// composition rounds them; layout as LaunchSwiGluGrad's.
const char* LaunchClampedSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type,
                                    int64_t rows, int64_t f, int64_t in_ld, int64_t out_ld, float alpha, float limit,
                                    void* grad_gate, void* grad_up, void* stream);

// Rotary embedding of x: batch x seq_len x heads x dim (dim even; x may be strided, with
// unit stride along dim: x_strides gives its batch, seq and head strides in elements), with
// cos/sin tables of rows x dim indexed by each token's position: positions[token] when
// non-null, else the token's index within its sequence. y: token t's head h at
// y + t * y_token_stride + h * dim (heads * dim when contiguous; wider when y is a column
// slice of a packed projection's gradient).
//   forward:  y = x * cos + rotate_half(x) * sin      (rotate_half(x) = [-x2, x1])
//   backward: y = x * cos + rotate_half^T(x * sin)    (the gradient of the forward map)
const char* LaunchRope(const void* x, const int64_t* x_strides, const void* cos, const void* sin,
                       const int64_t* positions, ElementType type, int64_t batch, int64_t seq_len,
                       int64_t heads, int64_t dim, bool backward, void* y, int64_t y_token_stride,
                       void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_FUSED_LAYER_H_
