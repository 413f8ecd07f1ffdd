// The Gated DeltaNet pieces of Qwen3.5 / Qwen3-Next's linear-attention layers, as ATen
// compositions (autograd gives every backward but the chunked rule's, which is written out),
// in transformers' order of operations:
//  - the gated delta rule: a state S [dk, dv] per value head; at each token
//      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  out = S^T (q / sqrt(dk)),
//    with q and k L2-normalized first. GatedDeltaRule runs it in chunks of `chunk_size`
//    tokens (a unit-triangular solve within each chunk, one state update per chunk); the
//    same numbers as the token-by-token recurrence (GatedDeltaRuleStep), to rounding.
//  - the short causal depthwise convolution over q/k/v's projections, with SiLU;
//  - the gated RMSNorm on the output: RMSNorm(x) * w * SiLU(z).
// Packed rows: every sequence starts from a zero state and a zero convolution history.
#ifndef LORASTEP_LIB_MODEL_GATED_DELTA_H_
#define LORASTEP_LIB_MODEL_GATED_DELTA_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "lib/model/model_config.h"

namespace lorastep {

// One sequence (or a batch of equal-length ones): q, k [b, T, hk, dk], v [b, T, hv, dv] with hk
// dividing hv (each query/key head serves hv / hk consecutive value heads), g (log decay, <= 0)
// and beta [b, T, hv]; `state` [b, hv, dk, dv] or undefined (zeros). Computes in fp32 (fp64 for
// fp64 inputs) and returns the output [b, T, hv, dv] in q's dtype and the final state.
std::pair<at::Tensor, at::Tensor> GatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                                                 const at::Tensor& state = at::Tensor());

// The same rule one token at a time (decoding: T is usually 1), from `state` (undefined: zeros).
std::pair<at::Tensor, at::Tensor> GatedDeltaRuleStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& g, const at::Tensor& beta,
                                                     const at::Tensor& state = at::Tensor());

// GatedDeltaRule over sequences packed back to back in one row (q ... [1, total, ...], `lengths`
// summing to total), each from a zero state. Returns the output [1, total, hv, dv].
at::Tensor PackedGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const std::vector<int64_t>& lengths, int64_t chunk_size);

// (I + L)^-1 for strictly lower-triangular L [.., c, c]: the series sum_k (-L)^k ends at
// k = c - 1 (L is nilpotent), summed as (I + X)(I + X^2)(I + X^4)... with X = -L, in
// ceil(log2 c) steps of two matmuls.
at::Tensor UnitLowerInverse(const at::Tensor& strictly_lower);

// Causal depthwise convolution with SiLU: x [b, T, C], weight [C, K] (transformers' conv1d
// weight [C, 1, K] squeezed), no bias: out[t] = silu(sum_j w[:, j] x[t - K + 1 + j]), with zeros
// before the start. `lengths` (non-empty: b = 1, sequences back to back): each sequence starts
// from zeros.
at::Tensor CausalConv1dSilu(const at::Tensor& x, const at::Tensor& weight,
                            const std::vector<int64_t>& lengths = {});

// The same over x [b, T, C] (b sequences of T) as one CUDA kernel each way
// (lib/kernels/causal_conv.h), for a weight of x's type with at most 8 taps that takes no
// gradient; undefined where the build or the tensors do not allow it. CausalConv1dSilu takes
// it unless LORASTEP_FUSED_CONV=0 (the composition, for a side-by-side timing).
at::Tensor FusedCausalConv1dSilu(const at::Tensor& x, const at::Tensor& weight);

// RMSNorm(x) * weight * silu(z) over the last dim (Qwen3.5's gated norm): the normalization in
// fp32, the weight applied in x's dtype, the gate in fp32, the result in x's dtype.
// On CUDA one fused kernel each way (lib/kernels/fused_layer.h) with the same rounding.
at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps);

// The log decay and the write strength from the layer's per-head projections a and b [.., hv]:
// g = -exp(A_log) softplus(a + dt_bias) (fp32), beta = sigmoid(b).
std::pair<at::Tensor, at::Tensor> GatedDeltaGates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                                  const at::Tensor& dt_bias);

// A Gated DeltaNet layer's own tensors (transformers' linear_attn.conv1d.weight [C, 1, K],
// A_log and dt_bias [value heads], norm.weight [value head dim]).
struct GatedDeltaWeights {
  at::Tensor conv1d, a_log, dt_bias, norm;
};

// The sampler's per-sequence state of the linear-attention layers, beside its cached attention:
// for sequence `index` of a packed row at decoder layer `layer`, the convolution's input
// history (the last K - 1 rows of in_proj_qkv's output, [K - 1, C], in the model dtype) and
// the rule's state ([value heads, dk, dv], fp32). Undefined: a sequence's start (zeros).
class RecurrentStates {
 public:
  virtual ~RecurrentStates() = default;
  virtual std::pair<at::Tensor, at::Tensor> Get(int64_t layer, size_t index) = 0;
  virtual void Set(int64_t layer, size_t index, at::Tensor history, at::Tensor state) = 0;
};

// Context parallelism: this rank holds some tokens of the packed row. `whole` turns a
// per-token tensor of its tokens [1, t, ...] into the whole row's [1, total, ...] (every
// rank's tokens gathered, differentiable: its backward sums the ranks' gradients), `own`
// (int64 [t]) is its tokens' positions in the whole row.
struct ContextRows {
  std::function<at::Tensor(const at::Tensor&)> whole;
  at::Tensor own;
};

// Chunk length of the rule in training and Forward (transformers' default).
inline constexpr int64_t kGatedDeltaChunk = 64;

// The token mixer of a Gated DeltaNet layer over the normed input h [b, s, H]: `project(slot,
// x)` applies the layer's projection `slot` (a LinearSlot from kInProjQkv on, LoRA included):
// q/k/v through the convolution, the gates from a and b, the rule, the gated norm with z, then
// out_proj. `lengths` (non-empty: b = 1, sequences packed back to back): each restarts, or
// with `states` continues from its state at decoder layer `layer` and leaves the new one there.
// `context` (h holds this rank's tokens; `lengths` are the whole sequences'): the projections
// and the gated norm run on this rank's tokens, the convolution and the rule over the whole
// row gathered from every rank (each rank computes it, and keeps its tokens' outputs).
// In training the rule keeps its intermediates for backward with `keep_rule`, else only its
// inputs, running again in backward (the same results).
at::Tensor GatedDeltaNetMix(const LinearAttentionConfig& config, const GatedDeltaWeights& weights,
                            const std::function<at::Tensor(int, const at::Tensor&)>& project, const at::Tensor& h,
                            const std::vector<int64_t>& lengths, double eps, RecurrentStates* states = nullptr,
                            int64_t layer = 0, const ContextRows* context = nullptr, bool keep_rule = false);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_GATED_DELTA_H_
