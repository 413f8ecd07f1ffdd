// Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's
// denominator and takes no value) on top of an attention kernel that has none, through the
// kernel's softmax statistics, so that a layer with sinks runs the fused kernels of one
// without them.
//
// For one query and head, with o the kernel's output and L the log-sum-exp of its scaled
// scores, a sink logit s adds exp(s) to the denominator:
//   out = o * exp(L) / (exp(L) + exp(s)) = o * sigmoid(L - s).
// Backward runs the kernel's own backward once, with the gradient g * sigmoid(L - s) and
// with `out` in place of o: the kernel forms the softmax gradient from the row sums of
// dO * O, and with these two in place those sums are exactly the ones the softmax with the
// sink needs (the factor's own dependence on L included). The sinks' gradient is
// -sum over queries of (1 - sigmoid(L - s)) * (g . out).
#ifndef LORASTEP_LIB_MODEL_SINK_ATTENTION_H_
#define LORASTEP_LIB_MODEL_SINK_ATTENTION_H_

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>

namespace lorastep {

// A causal attention kernel that exposes its log-sum-exp and takes it back in its backward
// (flash attention's contract). Token-major layouts: q [t, heads, d], k/v [t, kv_heads, d].
// One object serves one forward and its backward (it may keep what the kernel's backward
// needs besides these).
class LseAttentionKernel {
 public:
  virtual ~LseAttentionKernel() = default;
  // The output [t, heads, d] and the log-sum-exp of the scaled scores [heads, t] (fp32).
  virtual std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) = 0;
  // (dq, dk, dv) for the output gradient `grad`, from the forward's inputs, an output `out`
  // and the forward's log-sum-exp `lse`, as the kernel's backward forms them.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor> Backward(const at::Tensor& grad, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse) = 0;
};

// Attention with sinks [heads] through `kernel`: q [t, heads, d], k/v [t, kv_heads, d] ->
// [t, heads, d], differentiable in q, k, v and (when they require it) the sinks. The factor
// is formed in fp32 (fp64 for fp64 inputs).
at::Tensor SinkAttentionThroughLse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& sinks, std::shared_ptr<LseAttentionKernel> kernel);

// The same in two pieces without autograd, for a caller that keeps the forward's results
// itself (a selectively recomputed layer's attention): the output and what backward needs,
// then (dq, dk, dv, dsinks; dsinks only with `sinks_grad`, in the forward's fp32 or wider type)
// for the output's gradient.
struct SinkAttentionSaved {
  at::Tensor out, lse, kept;  // kept: sigmoid(lse - sink) [t, heads, 1]
  std::shared_ptr<LseAttentionKernel> kernel;
};
SinkAttentionSaved SinkAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& sinks, std::shared_ptr<LseAttentionKernel> kernel);
std::array<at::Tensor, 4> SinkAttentionBackward(const SinkAttentionSaved& saved, const at::Tensor& grad,
                                                const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool sinks_grad);

// Whether packed rows with sinks run the flash varlen kernel through SinkAttentionThroughLse
// (CUDA, where compat::HasVarlenAttention holds), unless LORASTEP_SINK_FLASH=0 (the explicit
// mask, for a side-by-side timing).
bool UseSinkFlash(const at::Tensor& q);

// A log-sum-exp padded per sequence, [count, heads, longest] (what some builds' varlen kernel
// returns), by token: [heads, total] for the sequences of cu_seqlens (int32 [count + 1]).
at::Tensor PaddedLseByToken(const at::Tensor& padded, const at::Tensor& cu_seqlens, int64_t total);

// The flash varlen kernel over packed sequences (cu_seqlens int32 [count + 1], the longest
// `max_length`), causal, in a sliding window where `window` > 0.
std::shared_ptr<LseAttentionKernel> VarlenFlashLseKernel(at::Tensor cu_seqlens, int64_t max_length, int64_t window);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_SINK_ATTENTION_H_
