// Every difference between Debian's LibTorch 1.13 (CPU) and torch 2.11 (CUDA) that lorastep
// touches lives here, so the rest of lib/ compiles unchanged against both.
#ifndef LORASTEP_LIB_TORCH_COMPAT_H_
#define LORASTEP_LIB_TORCH_COMPAT_H_

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#define LORASTEP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace lorastep {
namespace compat {

// out_fp32 += alpha * (a @ b) with fp32 accumulation, in place: the fused weight-gradient
// GEMM. On CUDA with torch >= 2.5 and bf16/fp16 inputs this is one cuBLAS GEMM with
// C = alpha·A·B + 1·C and an fp32 C (aten::addmm.dtype_out); elsewhere the inputs are upcast
// first (same math).
inline void AddMatmulFp32(at::Tensor& out_fp32, const at::Tensor& a, const at::Tensor& b,
                          double alpha = 1.0) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  if (a.is_cuda() && a.scalar_type() != at::kFloat && a.scalar_type() == b.scalar_type()) {
    at::addmm_out(out_fp32, out_fp32, a, b, at::kFloat, /*beta=*/1, /*alpha=*/alpha);
    return;
  }
#endif
  out_fp32.addmm_(a.to(at::kFloat), b.to(at::kFloat), /*beta=*/1, /*alpha=*/alpha);
}

// [s, s] bool: query i sees key j when 0 <= i - j, and i - j < window where window > 0.
inline at::Tensor CausalMask(int64_t s, int64_t window, const at::Device& device) {
  const at::Tensor pos = at::arange(s, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor back = pos.unsqueeze(1) - pos.unsqueeze(0);  // i - j
  return window > 0 ? back.ge(0).logical_and(back.lt(window)) : back.ge(0);
}

// Attention of q over k, v [b, heads, s, d] (heads already repeated) where `seen` [s, s]
// (bool) is true: SDPA with the mask on torch >= 2.0, else the product with an fp32 softmax.
inline at::Tensor MaskedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& seen) {
#if LORASTEP_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/seen, /*dropout_p=*/0.0, /*is_causal=*/false);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(seen.logical_not(), -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v);
#endif
}

// Causal self-attention. q: [b, heads, s, d]; k, v: [b, kv_heads, s, d] with kv_heads
// dividing heads (grouped-query attention: each K/V head serves heads/kv_heads query heads).
// torch >= 2.5: fused SDPA reading the K/V heads in place (enable_gqa: bitwise equal to
// repeating K/V first, and without that copy; docs/PERFORMANCE.md has the timing).
inline at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t groups = q.size(1) / k.size(1);
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*scale=*/c10::nullopt,
                                          /*enable_gqa=*/groups > 1);
#else
  const at::Tensor kr = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const at::Tensor vr = groups > 1 ? v.repeat_interleave(groups, 1) : v;
#if LORASTEP_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, kr, vr, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  const int64_t s = q.size(-2);
  return MaskedAttention(q, kr, vr, at::ones({s, s}, q.options().dtype(at::kBool)).tril());
#endif
#endif
}

// Causal self-attention within a sliding window: query i sees keys i - window < j <= i
// (transformers' sliding_window_overlay). q, k, v as CausalAttention. An explicit [s, s] mask
// with K/V heads repeated: correct on every build, at full attention's cost (no block of the
// mask is skipped).
inline at::Tensor WindowedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          int64_t window) {
  const int64_t groups = q.size(1) / k.size(1), s = q.size(-2);
  const at::Tensor kr = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const at::Tensor vr = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  return MaskedAttention(q, kr, vr, CausalMask(s, window, q.device()));
}

// Softmax over the last dim of `scores` with one more logit per row that takes no value
// (gpt-oss's attention sink): `sink` broadcasts to scores' shape with a last dim of 1, its
// column dropped after the softmax. Undefined `sink`: the plain softmax. In scores' dtype.
inline at::Tensor SoftmaxWithSink(const at::Tensor& scores, const at::Tensor& sink) {
  if (!sink.defined()) return at::softmax(scores, -1);
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = 1;
  const at::Tensor column = sink.to(scores.scalar_type()).expand(shape);
  return at::softmax(at::cat({scores, column}, -1), -1).narrow(-1, 0, scores.size(-1));
}

// Causal attention (window 0: every earlier key; else the sliding window) with gpt-oss's
// attention sinks: a learned logit per query head, sinks [heads], joins each softmax's
// denominator and takes no value. q, k, v as CausalAttention. Scores and softmax in fp32,
// through an explicit mask; gradients reach the sinks when they require them.
inline at::Tensor SinkCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      int64_t window, const at::Tensor& sinks) {
  const int64_t groups = q.size(1) / k.size(1), s = q.size(-2);
  const at::Tensor kr = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const at::Tensor vr = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, kr.transpose(-2, -1)).to(at::kFloat) * scale;
  scores = scores.masked_fill(CausalMask(s, window, q.device()).logical_not(), -std::numeric_limits<float>::infinity());
  const at::Tensor probs = SoftmaxWithSink(scores, sinks.view({1, -1, 1, 1}));
  return at::matmul(probs.to(q.scalar_type()), vr);
}

// Causal attention over sequences packed back to back: q [total, heads, d], k/v [total,
// kv_heads, d], cu_seqlens int32 [count + 1]. One flash-attention varlen kernel each way,
// reading grouped K/V heads in place, where the torch build and dtype have it (CUDA,
// bf16/fp16, d a multiple of 8 up to 256); undefined elsewhere (callers loop over sequences).
inline bool HasVarlenAttention(const at::Tensor& q) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
         q.size(-1) % 8 == 0 && q.size(-1) <= 256;
#else
  (void)q;
  return false;
#endif
}

// The forward keeping what its backward needs: the output [total, heads, d], the softmax
// log-sum-exp (fp32) and the kernel's random-number state (unused without dropout).
// With these, VarlenCausalAttentionBackward gives the input gradients without a second
// forward (selective activation recomputation keeps them instead of replaying attention).
// `window` > 0: each query sees itself and the window - 1 keys before it (a sliding layer,
// CausalMask's rule), and the kernel skips the blocks outside the window.
struct VarlenAttentionSaved {
  at::Tensor out, logsumexp, rng_state, rng_unused;
  int64_t window = 0;
};
// The flash kernel's (window_size_left, window_size_right) for `window` (unset: unbounded).
inline std::pair<c10::optional<int64_t>, c10::optional<int64_t>> FlashWindow(int64_t window) {
  if (window <= 0) return {c10::nullopt, c10::nullopt};
  return {window - 1, 0};
}
inline VarlenAttentionSaved VarlenCausalAttentionSaved(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens, int64_t max_length,
                                                       int64_t window = 0) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  const auto [left, right] = FlashWindow(window);
  auto r = at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, /*dropout_p=*/0.0,
                                        /*is_causal=*/true, /*return_debug_mask=*/false, /*scale=*/c10::nullopt,
                                        left, right);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), window};
#else
  (void)q, (void)k, (void)v, (void)cu_seqlens, (void)max_length, (void)window;
  return {};
#endif
}
// Its output only.
inline at::Tensor VarlenCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cu_seqlens, int64_t max_length, int64_t window = 0) {
  return VarlenCausalAttentionSaved(q, k, v, cu_seqlens, max_length, window).out;
}

// (dq, dk, dv) of VarlenCausalAttentionSaved's output for its gradient `grad_out`.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> VarlenCausalAttentionBackward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const VarlenAttentionSaved& saved, const at::Tensor& cu_seqlens, int64_t max_length) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  const auto [left, right] = FlashWindow(saved.window);
  return at::_flash_attention_backward(grad_out.contiguous(), q, k, v, saved.out, saved.logsumexp, cu_seqlens,
                                       cu_seqlens, max_length, max_length, /*dropout_p=*/0.0, /*is_causal=*/true,
                                       saved.rng_state, saved.rng_unused, /*scale=*/c10::nullopt, left, right);
#else
  (void)grad_out, (void)q, (void)k, (void)v, (void)saved, (void)cu_seqlens, (void)max_length;
  return {};
#endif
}

// cuDNN's fused causal attention over padded rows, keeping what its backward needs, so
// selective recomputation skips attention's forward in the replay as with the flash kernel.
// q [b, heads, s, d], k/v [b, kv_heads, s, d] (grouped heads read in place), laid out as SDPA
// gets them. UsesCudnnAttention says whether SDPA itself picks cuDNN for these inputs (torch
// >= 2.5, CUDA): the kept forward then runs the very kernel CausalAttention runs.
inline bool UsesCudnnAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  if (!q.is_cuda()) return false;
  constexpr int64_t kCudnnAttention = 3;  // sdp::SDPBackend::cudnn_attention
  return at::_fused_sdp_choice(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                               /*scale=*/c10::nullopt, /*enable_gqa=*/q.size(1) != k.size(1)) == kCudnnAttention;
#else
  (void)q, (void)k, (void)v;
  return false;
#endif
}
struct CudnnAttentionSaved {
  at::Tensor out, logsumexp, cum_q, cum_k, philox_seed, philox_offset;
  int64_t max_q = 0, max_k = 0;
};
inline CudnnAttentionSaved CudnnCausalAttentionSaved(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, /*attn_bias=*/{}, /*compute_log_sumexp=*/true,
                                                   /*dropout_p=*/0.0, /*is_causal=*/true,
                                                   /*return_debug_mask=*/false);
  CudnnAttentionSaved saved;
  saved.out = std::get<0>(r), saved.logsumexp = std::get<1>(r);
  saved.cum_q = std::get<2>(r), saved.cum_k = std::get<3>(r);
  saved.max_q = std::get<4>(r).guard_int(__FILE__, __LINE__);
  saved.max_k = std::get<5>(r).guard_int(__FILE__, __LINE__);
  saved.philox_seed = std::get<6>(r), saved.philox_offset = std::get<7>(r);
  return saved;
#else
  (void)q, (void)k, (void)v;
  return {};
#endif
}
// (dq, dk, dv) of CudnnCausalAttentionSaved's output for its gradient `grad_out` [b, heads, s, d].
// The kernel reads the gradient with the output's strides, so a gradient laid out otherwise is
// copied into that layout first.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> CudnnCausalAttentionBackward(const at::Tensor& grad_out,
                                                                                   const at::Tensor& q,
                                                                                   const at::Tensor& k,
                                                                                   const at::Tensor& v,
                                                                                   const CudnnAttentionSaved& saved) {
#if LORASTEP_TORCH_AT_LEAST(2, 5)
  const at::Tensor g = grad_out.strides() == saved.out.strides() ? grad_out : at::empty_like(saved.out).copy_(grad_out);
  return at::_scaled_dot_product_cudnn_attention_backward(
      g, q, k, v, saved.out, saved.logsumexp, saved.philox_seed, saved.philox_offset, /*attn_bias=*/{}, saved.cum_q,
      saved.cum_k, saved.max_q, saved.max_k, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  (void)grad_out, (void)q, (void)k, (void)v, (void)saved;
  return {};
#endif
}

// Grouped GEMM (torch >= 2.8, CUDA, bf16/fp16 on Hopper: one CUTLASS kernel for all groups).
// a [M, K] x b [G, K, N] with int32 `offs` (cumulative row ends of each group) -> [M, N];
// a [M, K] x b [K, N] with offs over K -> [G, M, N]. Undefined where unavailable.
inline bool HasGroupedMm(const at::Tensor& a) {
#if LORASTEP_TORCH_AT_LEAST(2, 8)
  return a.is_cuda() && (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf);
#else
  (void)a;
  return false;
#endif
}
inline at::Tensor GroupedMm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
#if LORASTEP_TORCH_AT_LEAST(2, 8)
  return at::_grouped_mm(a, b, offs);
#else
  (void)a, (void)b, (void)offs;
  return at::Tensor();
#endif
}

// The integer type of MemoryReportingInfoBase::reportMemoryUsage's totals.
#if LORASTEP_TORCH_AT_LEAST(2, 0)
using MemoryTotal = size_t;
#else
using MemoryTotal = int64_t;
#endif

// c10d's collective backend base class: ProcessGroupGloo/NCCL derive from ProcessGroup in
// 1.13 and from Backend since 2.0 (same allreduce/allgather/send/recv/barrier methods).
// A macro, so this header needs no c10d include.
#if LORASTEP_TORCH_AT_LEAST(2, 0)
#define LORASTEP_C10D_BACKEND ::c10d::Backend
#else
#define LORASTEP_C10D_BACKEND ::c10d::ProcessGroup
#endif

}  // namespace compat
}  // namespace lorastep

#endif  // LORASTEP_LIB_TORCH_COMPAT_H_
