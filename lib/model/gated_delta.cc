#include "lib/model/gated_delta.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "lib/env_switch.h"
#include "lib/model/fused_kernels.h"
#include "lib/model/lora_config.h"
#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/causal_conv.h"
#include "lib/kernels/fused_layer.h"
#include "lib/kernels/kernel_launch.h"
#endif

namespace lorastep {
namespace {

// fp32 (as transformers), or fp64 for fp64 inputs.
at::ScalarType WideType(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// x / sqrt(sum x^2 + 1e-6) over the last dim (the normalization the FLA kernels use).
at::Tensor L2Normalized(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

// The rule's operands in fp32, heads first: q (normalized, scaled by 1/sqrt(dk)) and k
// (normalized) repeated up to the value heads, v, g and beta.
struct RuleOperands {
  at::Tensor q, k, v, g, beta;  // [b, hv, T, d] / [b, hv, T]
};

RuleOperands Prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta) {
  const int64_t hk = q.size(2), hv = v.size(2);
  TORCH_CHECK(hv % hk == 0, "gated delta rule: ", hk, " query/key heads do not divide ", hv, " value heads");
  const at::ScalarType type = WideType(q);
  auto heads_first = [type](const at::Tensor& x) { return x.transpose(1, 2).to(type).contiguous(); };
  at::Tensor qr = hk == hv ? q : q.repeat_interleave(hv / hk, 2);
  at::Tensor kr = hk == hv ? k : k.repeat_interleave(hv / hk, 2);
  RuleOperands o;
  o.q = L2Normalized(heads_first(qr)) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  o.k = L2Normalized(heads_first(kr));
  o.v = heads_first(v);
  o.g = g.transpose(1, 2).to(type);
  o.beta = beta.transpose(1, 2).to(type);
  return o;
}

at::Tensor InitialState(const at::Tensor& state, const RuleOperands& o) {
  if (state.defined()) return state.to(o.v.scalar_type());
  return at::zeros({o.v.size(0), o.v.size(1), o.q.size(3), o.v.size(3)}, o.v.options());
}

// Sequences packed back to back along dim 1 of [1, total, ...] as a batch [n, longest, ...]
// with zeros after each sequence's end, and back: the rule and the convolution are causal, so
// a sequence's outputs do not see the zeros after it, and one batched pass runs
// longest / chunk chunk steps instead of one pass per sequence. One index kernel each way
// (autograd passes through), none when the lengths are equal.
class PackedBatch {
 public:
  PackedBatch(const std::vector<int64_t>& lengths, const at::Device& device)
      : n_(static_cast<int64_t>(lengths.size())),
        longest_(lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end())) {
    TORCH_CHECK(n_ > 0, "packed sequences: no lengths");
    total_ = 0;
    std::vector<int64_t> rows;
    for (int64_t j = 0; j < n_; ++j) {
      for (int64_t t = 0; t < lengths[j]; ++t) rows.push_back(j * longest_ + t);
      total_ += lengths[j];
    }
    if (total_ != n_ * longest_) {
      index_ = at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(device);
    }
  }

  at::Tensor Batch(const at::Tensor& x) const {  // [1, total, rest...] -> [n, longest, rest...]
    TORCH_CHECK(x.size(0) == 1 && x.size(1) == total_, "packed sequences: ", total_, " tokens expected");
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = n_;
    shape[1] = longest_;
    if (!index_.defined()) return x.reshape(shape);
    const at::Tensor rows = x.reshape({total_, -1});
    return at::zeros({n_ * longest_, rows.size(1)}, x.options()).index_copy(0, index_, rows).reshape(shape);
  }

  at::Tensor Unbatch(const at::Tensor& y) const {  // [n, longest, rest...] -> [1, total, rest...]
    std::vector<int64_t> shape = y.sizes().vec();
    shape[0] = 1;
    shape[1] = total_;
    if (!index_.defined()) return y.reshape(shape);
    return y.reshape({n_ * longest_, -1}).index_select(0, index_).reshape(shape);
  }

 private:
  int64_t n_, longest_, total_;
  at::Tensor index_;  // rows of the batch that hold tokens; undefined when none is padding
};

}  // namespace

at::Tensor UnitLowerInverse(const at::Tensor& strictly_lower) {
  const int64_t c = strictly_lower.size(-1);
  at::Tensor power = -strictly_lower;
  at::Tensor inverse = power + at::eye(c, power.options());
  for (int64_t span = 2; span < c; span *= 2) {  // (I + X)(I + X^2)(I + X^4)..., X = -L
    power = at::matmul(power, power);
    inverse = inverse + at::matmul(inverse, power);
  }
  return inverse;
}

namespace {

// The sequential part of the chunked rule, chunk-major ([n chunks, B = b * heads, ...]): from
// the state S_0 at the first chunk's start,
//   V_i = NV_i - KC_i S_i,   S_{i+1} = d_i S_i + KE_i^T V_i
// (NV the chunk's solved values, KC its decayed keys read through the solve, KE its keys
// decayed to the chunk's end, d its whole decay). Returns every S_i (i = 0..n: the chunk
// starts and the final state) and every V_i, in three kernels per chunk.
std::pair<at::Tensor, at::Tensor> RecurrenceForward(const at::Tensor& nv, const at::Tensor& kc, const at::Tensor& ke,
                                                    const at::Tensor& decay, const at::Tensor& s0) {
  const int64_t n = nv.size(0), batch = nv.size(1);
  at::Tensor states = at::empty({n + 1, batch, kc.size(-1), nv.size(-1)}, nv.options());
  at::Tensor values = at::empty_like(nv);
  states.select(0, 0).copy_(s0);
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor s = states.select(0, i), v = values.select(0, i), next = states.select(0, i + 1);
    at::baddbmm_out(v, nv.select(0, i), kc.select(0, i), s, /*beta=*/1, /*alpha=*/-1);
    at::mul_out(next, s, decay.select(0, i).view({batch, 1, 1}));
    next.baddbmm_(ke.select(0, i).transpose(-1, -2), v);
  }
  return {states, values};
}

// The recurrence's gradients from those of every S_i (d_states, i = 0..n) and V_i
// (d_values): the reverse recurrence in three kernels per chunk, the rest as batched matmuls
// over all chunks. Returns d NV, d KC, d KE, d decay and d S_0.
std::array<at::Tensor, 5> RecurrenceBackward(const at::Tensor& kc, const at::Tensor& ke, const at::Tensor& decay,
                                             const at::Tensor& states, const at::Tensor& values,
                                             const at::Tensor& d_states, const at::Tensor& d_values) {
  const int64_t n = values.size(0), batch = values.size(1);
  // arriving[i]: the whole gradient reaching S_{i+1} (its own and through every later chunk).
  at::Tensor arriving = at::empty({n, batch, states.size(-2), states.size(-1)}, states.options());
  at::Tensor d_v = at::empty_like(values);
  at::Tensor d_s0 = at::empty_like(states.select(0, 0));
  arriving.select(0, n - 1).copy_(d_states.select(0, n));
  for (int64_t i = n - 1; i >= 0; --i) {
    at::Tensor ds = arriving.select(0, i), dv = d_v.select(0, i);
    at::baddbmm_out(dv, d_values.select(0, i), ke.select(0, i), ds);
    at::Tensor into = i > 0 ? arriving.select(0, i - 1) : d_s0;
    at::addcmul_out(into, d_states.select(0, i), ds, decay.select(0, i).view({batch, 1, 1}));
    into.baddbmm_(kc.select(0, i).transpose(-1, -2), dv, /*beta=*/1, /*alpha=*/-1);
  }
  const at::Tensor starts = states.narrow(0, 0, n);
  return {d_v, -at::matmul(d_v, starts.transpose(-1, -2)), at::matmul(values, arriving.transpose(-1, -2)),
          (starts * arriving).sum({-2, -1}), d_s0};
}

// (I + L)^-1 for strictly lower-triangular L: one triangular solve against the identity, or
// the doubling series (LORASTEP_GDN_TRIANGULAR_SOLVE=0), for side-by-side timing.
at::Tensor UnitLowerInverseOf(const at::Tensor& strictly_lower) {
  static const bool triangular_solve = EnvSwitchOn("LORASTEP_GDN_TRIANGULAR_SOLVE");
  if (!triangular_solve) return UnitLowerInverse(strictly_lower);
  const int64_t c = strictly_lower.size(-1);
  return at::linalg_solve_triangular(strictly_lower,
                                     at::eye(c, strictly_lower.options()).expand(strictly_lower.sizes()),
                                     /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

// The chunked rule on chunk-major operands ([n, B, c, d]; beta and g [n, B, c]; padded tokens
// with zero keys, values, write and decay), from state S_0 [B, dk, dv]: returns the outputs
// [n, B, c, dv] and the final state. Within a chunk, with cum the cumulative log decay,
// E = exp(cum), P_ij = exp(cum_i - cum_j) (i >= j, 0 above):
//   Sys = tril(beta K K^T . P, -1), A = (I + Sys)^-1,
//   [NV | KC] = A [beta V | beta K . E]   (the delta rule's updates as one unit-lower system),
//   O = (Q . E) S_i + (Q K^T . P) V_i     with S_i, V_i from the recurrence (RecurrenceForward),
// KE = K . exp(cum_last - cum) and d = exp(cum_last). The backward is written out (Backward
// below): about forty batched operations and the reverse recurrence, where autograd through
// the same composition keeps and replays about a hundred, with their copies.
class ChunkedRule : public torch::autograd::Function<ChunkedRule> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                                                const at::Tensor& g, const at::Tensor& s0) {
    at::NoGradGuard no_grad;
    const int64_t c = q.size(-2), dv = v.size(-1), dk = k.size(-1), n = q.size(0);
    const at::Tensor cum = g.cumsum(-1), e = cum.exp();
    const at::Tensor upper = at::ones({c, c}, cum.options().dtype(at::kBool)).triu(1);
    const at::Tensor p =
        (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, -std::numeric_limits<float>::infinity()).exp();
    const at::Tensor kb = k * beta.unsqueeze(-1);
    const at::Tensor kk = at::matmul(kb, k.transpose(-1, -2));
    const at::Tensor qk = at::matmul(q, k.transpose(-1, -2));
    const at::Tensor intra = qk * p;
    const at::Tensor inverse = UnitLowerInverseOf((kk * p).tril(-1));
    const at::Tensor solved = at::matmul(inverse, at::cat({v * beta.unsqueeze(-1), kb * e.unsqueeze(-1)}, -1));
    const at::Tensor to_end = (cum.narrow(-1, c - 1, 1) - cum).exp();
    const at::Tensor ke = k * to_end.unsqueeze(-1), decay = cum.select(-1, c - 1).exp();
    const at::Tensor kc = solved.narrow(-1, dv, dk);
    auto [states, values] = RecurrenceForward(solved.narrow(-1, 0, dv), kc, ke, decay, s0);
    const at::Tensor qd = q * e.unsqueeze(-1);
    at::Tensor out = at::matmul(qd, states.narrow(0, 0, n)).add_(at::matmul(intra, values));
    // K . beta, Q . E and KE are one multiply each from what is kept: backward forms them again.
    ctx->save_for_backward({q, k, v, beta, e, p, kk, qk, intra, inverse, solved, to_end, decay, states, values});
    return {out, states.select(0, n)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto t = ctx->get_saved_variables();
    const at::Tensor &q = t[0], &k = t[1], &v = t[2], &beta = t[3], &e = t[4], &p = t[5], &kk = t[6], &qk = t[7],
                     &intra = t[8], &inverse = t[9], &solved = t[10], &to_end = t[11], &decay = t[12],
                     &states = t[13], &values = t[14];
    const at::Tensor kb = k * beta.unsqueeze(-1), qd = q * e.unsqueeze(-1), ke = k * to_end.unsqueeze(-1);
    const int64_t n = q.size(0), c = q.size(-2), dv = v.size(-1), dk = k.size(-1);
    const at::Tensor d_out = grads[0].defined() ? grads[0] : at::zeros_like(values);
    const at::Tensor starts = states.narrow(0, 0, n);
    // O = QD S + Intra V.
    at::Tensor d_states = at::zeros_like(states);
    d_states.narrow(0, 0, n).copy_(at::matmul(qd.transpose(-1, -2), d_out));
    if (grads[1].defined()) d_states.select(0, n).copy_(grads[1]);
    const at::Tensor d_qd = at::matmul(d_out, starts.transpose(-1, -2));
    const at::Tensor d_intra = at::matmul(d_out, values.transpose(-1, -2));
    const at::Tensor d_values = at::matmul(intra.transpose(-1, -2), d_out);
    auto [d_nv, d_kc, d_ke, d_decay, d_s0] =
        RecurrenceBackward(solved.narrow(-1, dv, dk), ke, decay, states, values, d_states, d_values);
    // [NV | KC] = A R, A = (I + Sys)^-1: dR = A^T d[NV | KC], dSys = -(dR [NV | KC]^T) below the diagonal.
    const at::Tensor d_rhs = at::matmul(inverse.transpose(-1, -2), at::cat({d_nv, d_kc}, -1));
    const at::Tensor d_sys = at::matmul(d_rhs, solved.transpose(-1, -2)).neg_().tril_(-1);
    const at::Tensor d_vb = d_rhs.narrow(-1, 0, dv), d_kbe = d_rhs.narrow(-1, dv, dk);
    at::Tensor d_kb = d_kbe * e.unsqueeze(-1);
    at::Tensor d_e = (d_kbe * kb).sum(-1);
    // Sys = tril(KK . P, -1) and Intra = QK . P.
    const at::Tensor d_kk = d_sys * p, d_qk = d_intra * p;
    const at::Tensor d_p = d_sys * kk + d_intra * qk;
    d_kb.add_(at::matmul(d_kk, k));
    at::Tensor d_k = at::matmul(d_kk.transpose(-1, -2), kb).add_(at::matmul(d_qk.transpose(-1, -2), q));
    at::Tensor d_q = at::matmul(d_qk, k).add_(d_qd * e.unsqueeze(-1));
    d_e.add_((d_qd * q).sum(-1));
    // KE = K . F, F = exp(cum_last - cum).
    d_k.add_(d_ke * to_end.unsqueeze(-1));
    const at::Tensor d_ff = (d_ke * k).sum(-1) * to_end;
    // The cumulative log decay: through E, P, F and d.
    at::Tensor d_cum = d_e * e;
    const at::Tensor d_pp = d_p * p;  // P is 0 above the diagonal: only i >= j contribute
    d_cum.add_(d_pp.sum(-1)).sub_(d_pp.sum(-2)).sub_(d_ff);
    d_cum.select(-1, c - 1).add_(d_ff.sum(-1)).add_(d_decay * decay);
    // Kb = K . beta, Vb = V . beta.
    d_k.add_(d_kb * beta.unsqueeze(-1));
    const at::Tensor d_beta = (d_kb * k).sum(-1).add_((d_vb * v).sum(-1));
    const at::Tensor d_v = d_vb * beta.unsqueeze(-1);
    // cum = cumsum(g): dg_j = sum over i >= j of d_cum_i.
    const at::Tensor d_g = d_cum.flip(-1).cumsum(-1).flip(-1);
    return {d_q, d_k, d_v, d_beta, d_g, d_s0};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> GatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                                                 const at::Tensor& state) {
  TORCH_CHECK(chunk_size >= 1, "gated delta rule: chunk_size must be >= 1");
  const int64_t b = v.size(0), length = v.size(1), hk = q.size(2), dk = q.size(3), h = v.size(2), dv = v.size(3);
  TORCH_CHECK(h % hk == 0, "gated delta rule: ", hk, " query/key heads do not divide ", h, " value heads");
  const at::ScalarType type = WideType(q);
  // A sequence shorter than a chunk is one chunk of its own length (no padding to solve).
  const int64_t c = std::max<int64_t>(1, std::min(chunk_size, length));
  const int64_t pad = (c - length % c) % c, chunks = (length + pad) / c;
  // [b, T, heads, d] (padded tokens: zero keys, values, decay and write) in chunk-major order
  // [chunks, b * h, c, d], each query/key head repeated for the h / heads value heads it
  // serves: one copy (with the cast) per operand; the recurrence steps along dim 0.
  auto chunk_major = [&](const at::Tensor& x) {
    const at::Tensor padded = pad > 0 ? at::constant_pad_nd(x, {0, 0, 0, 0, 0, pad}) : x;
    const int64_t heads = x.size(2), rep = h / heads, d = x.size(3);
    const at::Tensor src =
        padded.reshape({b, chunks, c, heads, 1, d}).expand({b, chunks, c, heads, rep, d}).permute({1, 0, 3, 4, 2, 5});
    return at::empty({chunks, b, heads, rep, c, d}, x.options().dtype(type)).copy_(src).view({chunks, b * h, c, d});
  };
  // q and k L2-normalized over the head dim (as the FLA kernels: x / sqrt(sum x^2 + 1e-6)),
  // q also scaled by 1 / sqrt(dk), before the heads are repeated.
  auto unit = [&](const at::Tensor& x, double scale) {
    const at::Tensor norm = at::linalg_vector_norm(x, 2, {-1}, /*keepdim=*/true, type);
    return x * (at::rsqrt(norm * norm + 1e-6) * scale);
  };
  const at::Tensor query = chunk_major(unit(q, 1.0 / std::sqrt(static_cast<double>(dk))));
  const at::Tensor start = state.defined() ? state.to(type).reshape({b * h, dk, dv})
                                           : at::zeros({b * h, dk, dv}, query.options());
  const torch::autograd::variable_list run =
      ChunkedRule::apply(query, chunk_major(unit(k, 1.0)), chunk_major(v), chunk_major(beta.unsqueeze(-1)).squeeze(-1),
                         chunk_major(g.unsqueeze(-1)).squeeze(-1), start);
  // Back to [b, T, h, dv] in q's dtype: one copy with the cast.
  const at::Tensor rows = at::empty({b, chunks, c, h, dv}, q.options())
                              .copy_(run[0].view({chunks, b, h, c, dv}).permute({1, 0, 3, 2, 4}))
                              .view({b, chunks * c, h, dv});
  return {pad > 0 ? rows.narrow(1, 0, length).contiguous() : rows, run[1].view({b, h, dk, dv})};
}

std::pair<at::Tensor, at::Tensor> GatedDeltaRuleStep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& g, const at::Tensor& beta,
                                                     const at::Tensor& state) {
  RuleOperands o = Prepare(q, k, v, g, beta);
  at::Tensor s = InitialState(state, o);
  std::vector<at::Tensor> outs;
  for (int64_t t = 0; t < o.v.size(2); ++t) {
    const at::Tensor kt = o.k.select(2, t).unsqueeze(-1);  // [b, h, dk, 1]
    s = s * o.g.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
    const at::Tensor predicted = (s * kt).sum(-2);  // S^T k: [b, h, dv]
    const at::Tensor delta = (o.v.select(2, t) - predicted) * o.beta.select(2, t).unsqueeze(-1);
    s = s + kt * delta.unsqueeze(-2);
    outs.push_back((s * o.q.select(2, t).unsqueeze(-1)).sum(-2));
  }
  return {at::stack(outs, 1).to(q.scalar_type()), s};
}

at::Tensor PackedGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const std::vector<int64_t>& lengths, int64_t chunk_size) {
  const PackedBatch batch(lengths, q.device());
  return batch.Unbatch(GatedDeltaRule(batch.Batch(q), batch.Batch(k), batch.Batch(v), batch.Batch(g),
                                      batch.Batch(beta), chunk_size)
                           .first);
}

namespace {

#ifdef LORASTEP_WITH_CUDA_KERNELS
// The convolution as one CUDA kernel each way (kernels::LaunchCausalConvSilu), keeping x for
// backward (which forms the pre-activation again); the weight is frozen.
class CausalConvSiluFunction : public torch::autograd::Function<CausalConvSiluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    const at::Tensor xc = x.contiguous(), w = weight.contiguous();
    at::Tensor y = at::empty_like(xc);
    const kernels::KernelLaunch launch(xc);
    kernels::CheckLaunch(kernels::LaunchCausalConvSilu(xc.data_ptr(), w.data_ptr(), kernels::ElementTypeOf(xc),
                                                       xc.size(0), xc.size(1), xc.size(2),
                                                       static_cast<int>(w.size(1)), y.data_ptr(), launch.stream),
                         "causal conv");
    ctx->save_for_backward({xc, w});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x);
    const kernels::KernelLaunch launch(x);
    kernels::CheckLaunch(kernels::LaunchCausalConvSiluGrad(g.data_ptr(), x.data_ptr(), w.data_ptr(),
                                                           kernels::ElementTypeOf(x), x.size(0), x.size(1),
                                                           x.size(2), static_cast<int>(w.size(1)), dx.data_ptr(),
                                                           launch.stream),
                         "causal conv gradient");
    return {dx, at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor FusedCausalConv1dSilu(const at::Tensor& x, const at::Tensor& weight) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (x.dim() == 3 && weight.dim() == 2 && x.size(2) == weight.size(0) && weight.size(1) <= kernels::kMaxConvTaps &&
      UseFusedKernels(x, weight) && !(at::GradMode::is_enabled() && weight.requires_grad())) {
    return CausalConvSiluFunction::apply(x, weight);
  }
#else
  (void)x, (void)weight;
#endif
  return at::Tensor();
}

at::Tensor CausalConv1dSilu(const at::Tensor& x, const at::Tensor& weight, const std::vector<int64_t>& lengths) {
  if (!lengths.empty()) {
    const PackedBatch batch(lengths, x.device());
    return batch.Unbatch(CausalConv1dSilu(batch.Batch(x), weight));
  }
  static const bool fused_kernel = EnvSwitchOn("LORASTEP_FUSED_CONV");
  if (fused_kernel) {
    if (at::Tensor fused = FusedCausalConv1dSilu(x, weight); fused.defined()) return fused;
  }
  const int64_t length = x.size(1), kernel = weight.size(1);
  const at::Tensor y = at::conv1d(x.transpose(1, 2).to(weight.scalar_type()), weight.unsqueeze(1), {},
                                  /*stride=*/1, /*padding=*/kernel - 1, /*dilation=*/1, /*groups=*/weight.size(0));
  return at::silu(y.narrow(2, 0, length)).transpose(1, 2).to(x.scalar_type());
}

namespace {

#ifdef LORASTEP_WITH_CUDA_KERNELS
// The gated norm as one CUDA kernel each way (kernels::LaunchGatedRmsNorm), keeping x, z and
// the per-row 1/rms for backward; the same rounding as the composition below.
class GatedRmsNormFunction : public torch::autograd::Function<GatedRmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& z,
                            const at::Tensor& weight, double eps) {
    const at::Tensor xc = x.contiguous(), zc = z.contiguous(), w = weight.contiguous();
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    at::Tensor y = at::empty_like(xc);
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    const kernels::KernelLaunch launch(xc);
    kernels::CheckLaunch(kernels::LaunchGatedRmsNorm(xc.data_ptr(), zc.data_ptr(), w.data_ptr(),
                                                     kernels::ElementTypeOf(xc), rows, hidden,
                                                     static_cast<float>(eps), y.data_ptr(), rstd.data_ptr<float>(),
                                                     launch.stream),
                         "gated rmsnorm");
    ctx->save_for_backward({xc, zc, w, rstd});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &z = saved[1], &w = saved[2], &rstd = saved[3];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x), dz = at::empty_like(z);
    const kernels::KernelLaunch launch(x);
    kernels::CheckLaunch(kernels::LaunchGatedRmsNormGrad(g.data_ptr(), x.data_ptr(), z.data_ptr(), w.data_ptr(),
                                                         rstd.data_ptr<float>(), kernels::ElementTypeOf(x),
                                                         x.numel() / x.size(-1), x.size(-1), dx.data_ptr(),
                                                         dz.data_ptr(), launch.stream),
                         "gated rmsnorm gradient");
    return {dx, dz, at::Tensor(), at::Tensor()};
  }
};

#endif

}  // namespace

at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  // The kernel keeps the weight frozen: full fine-tuning, which trains the norm, takes the composition.
  if (UseFusedKernels(x, z) && UseFusedKernels(x, weight) && x.sizes() == z.sizes() &&
      !(at::GradMode::is_enabled() && weight.requires_grad())) {
    return GatedRmsNormFunction::apply(x, z, weight, eps);
  }
#endif
  const at::ScalarType wide = WideType(x);
  const at::Tensor xf = x.to(wide);
  const at::Tensor normed = (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
  return ((weight * normed).to(wide) * at::silu(z.to(wide))).to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> GatedDeltaGates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                                  const at::Tensor& dt_bias) {
  const at::ScalarType wide = WideType(a);
  const at::Tensor g = -a_log.to(wide).exp() * at::softplus(a.to(wide) + dt_bias.to(wide));
  return {g, at::sigmoid(b)};
}

namespace {

// GatedDeltaRule keeping only its inputs for backward and running its forward again there:
// the chunked rule keeps its operands, the chunk system's inverse and solution and each
// chunk's state for backward, about 3 dk + 3 dv + 5 c + dk dv / c fp32 values per token and
// value head (about 1,300 at Qwen3.5's widths), several times a layer's other activations,
// and a second forward of the rule costs little beside the layer's projections.
class RecomputedRuleFunction : public torch::autograd::Function<RecomputedRuleFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size) {
    ctx->save_for_backward({q, k, v, g, beta});
    ctx->saved_data["chunk"] = chunk_size;
    return GatedDeltaRule(q, k, v, g, beta, chunk_size).first;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& saved : ctx->get_saved_variables()) inputs.push_back(saved.detach().requires_grad_(true));
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = GatedDeltaRule(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], ctx->saved_data["chunk"].toInt()).first;
    }
    torch::autograd::variable_list result = torch::autograd::grad({out}, inputs, {grads[0]});
    result.emplace_back();  // chunk_size
    return result;
  }
};

// The rule in training (grad mode on): keeping its intermediates (`keep`: ChunkedRule's) or
// recomputed in backward (RecomputedRuleFunction).
at::Tensor TrainedRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta, bool keep) {
  const bool grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                   g.requires_grad() || beta.requires_grad());
  if (!grad || keep) return GatedDeltaRule(q, k, v, g, beta, kGatedDeltaChunk).first;
  return RecomputedRuleFunction::apply(q, k, v, g, beta, kGatedDeltaChunk);
}

// The convolution's output [b, s, C] split into q, k [b, s, key heads, dk] and v [b, s, value
// heads, dv].
std::array<at::Tensor, 3> SplitQkv(const LinearAttentionConfig& config, const at::Tensor& mixed) {
  const int64_t b = mixed.size(0), s = mixed.size(1), kd = config.key_dim();
  return {mixed.narrow(-1, 0, kd).reshape({b, s, config.num_key_heads, config.key_head_dim}),
          mixed.narrow(-1, kd, kd).reshape({b, s, config.num_key_heads, config.key_head_dim}),
          mixed.narrow(-1, 2 * kd, config.value_dim()).reshape({b, s, config.num_value_heads, config.value_head_dim})};
}

// The rule over each packed sequence continuing from its state in `states` (the convolution
// first, over its history and the new rows), leaving the new state there. Decoding
// sequences (one new token each) run together as one batch of the token-by-token form: one
// state update each, no solve, and a handful of kernels for all of them; longer ones (prompt
// chunks) one at a time through the chunked form.
at::Tensor ContinuedRule(const LinearAttentionConfig& config, const at::Tensor& qkv, const at::Tensor& conv_weight,
                         const at::Tensor& g, const at::Tensor& beta, const std::vector<int64_t>& lengths,
                         RecurrentStates* states, int64_t layer) {
  const int64_t history = conv_weight.size(1) - 1, channels = qkv.size(2);
  std::vector<at::Tensor> outs(lengths.size());
  std::vector<int64_t> starts;
  int64_t start = 0;
  for (int64_t n : lengths) starts.push_back(start), start += n;
  // Sequence j's convolution history (zeros at its start) and rule state (undefined there).
  auto state_of = [&](size_t j) {
    auto [past, state] = states->Get(layer, j);
    if (!past.defined()) past = at::zeros({history, channels}, qkv.options());
    return std::make_pair(past, state);
  };
  std::vector<size_t> decoding;
  for (size_t j = 0; j < lengths.size(); ++j) {
    const int64_t n = lengths[j];
    if (n == 1) {
      decoding.push_back(j);
      continue;
    }
    const auto [past, state] = state_of(j);
    const at::Tensor rows = at::cat({past.unsqueeze(0), qkv.narrow(1, starts[j], n)}, 1);  // [1, K - 1 + n, C]
    const auto [q, k, v] = SplitQkv(config, CausalConv1dSilu(rows, conv_weight).narrow(1, history, n));
    const at::Tensor from = state.defined() ? state.unsqueeze(0) : at::Tensor();
    auto [out, next] = GatedDeltaRule(q, k, v, g.narrow(1, starts[j], n), beta.narrow(1, starts[j], n),
                                      kGatedDeltaChunk, from);
    states->Set(layer, j, rows.narrow(1, rows.size(1) - history, history)[0].clone(), next[0]);
    outs[j] = out;
  }
  if (!decoding.empty()) {
    std::vector<at::Tensor> pasts, froms;
    std::vector<int64_t> rows_of;
    at::Tensor fresh_state;  // a sequence's first token: zeros
    for (size_t j : decoding) {
      auto [past, state] = state_of(j);
      if (!state.defined()) {
        if (!fresh_state.defined()) {
          fresh_state = at::zeros({config.num_value_heads, config.key_head_dim, config.value_head_dim},
                                  qkv.options().dtype(WideType(g)));
        }
        state = fresh_state;
      }
      pasts.push_back(past);
      froms.push_back(state);
      rows_of.push_back(starts[j]);
    }
    const at::Tensor index = at::tensor(rows_of, at::kLong).to(qkv.device());
    auto tokens = [&](const at::Tensor& x) { return x[0].index_select(0, index).unsqueeze(1); };  // [N, 1, ...]
    const at::Tensor rows = at::cat({at::stack(pasts), tokens(qkv)}, 1);                       // [N, K, C]
    const auto [q, k, v] = SplitQkv(config, CausalConv1dSilu(rows, conv_weight).narrow(1, history, 1));
    auto [out, next] = GatedDeltaRuleStep(q, k, v, tokens(g), tokens(beta), at::stack(froms));
    for (size_t i = 0; i < decoding.size(); ++i) {
      const int64_t row = static_cast<int64_t>(i);
      // Views into this step's small batched tensors (the next step stacks them again).
      states->Set(layer, decoding[i], rows[row].narrow(0, 1, history), next[row]);
      outs[decoding[i]] = out.narrow(0, row, 1);
    }
  }
  return at::cat(outs, 1);
}

}  // namespace

at::Tensor GatedDeltaNetMix(const LinearAttentionConfig& config, const GatedDeltaWeights& weights,
                            const std::function<at::Tensor(int, const at::Tensor&)>& project, const at::Tensor& h,
                            const std::vector<int64_t>& lengths, double eps, RecurrentStates* states,
                            int64_t layer, const ContextRows* context, bool keep_rule) {
  const int64_t b = h.size(0), s = h.size(1), dv = config.value_head_dim;
  const at::Tensor qkv = project(kInProjQkv, h);
  auto [g, beta] = GatedDeltaGates(project(kInProjA, h), project(kInProjB, h), weights.a_log, weights.dt_bias);
  at::Tensor out;
  if (states != nullptr) {
    TORCH_CHECK(b == 1 && !lengths.empty(), "gated delta net: states need packed sequences");
    out = ContinuedRule(config, qkv, weights.conv1d.squeeze(1), g, beta, lengths, states, layer);
  } else {
    TORCH_CHECK(context == nullptr || !lengths.empty(), "gated delta net: context parallelism needs packed sequences");
    // Packed sequences run as one batch (PackedBatch): conv, split and rule on [n, longest, ..],
    // over the whole row when this rank holds part of it (context).
    const std::optional<PackedBatch> batch =
        lengths.empty() ? std::nullopt : std::make_optional<PackedBatch>(lengths, h.device());
    auto batched = [&](const at::Tensor& x) {
      const at::Tensor row = context != nullptr ? context->whole(x) : x;
      return batch ? batch->Batch(row) : row;
    };
    const auto [q, k, v] = SplitQkv(config, CausalConv1dSilu(batched(qkv), weights.conv1d.squeeze(1)));
    out = TrainedRule(q, k, v, batched(g), batched(beta), keep_rule);
    if (batch) out = batch->Unbatch(out);
    if (context != nullptr) out = out.index_select(1, context->own);
  }
  const at::Tensor z = project(kInProjZ, h);
  const at::Tensor normed = GatedRmsNorm(out.reshape({-1, dv}), z.reshape({-1, dv}), weights.norm, eps);
  return project(kOutProj, normed.reshape({b, s, config.value_dim()}));
}

}  // namespace lorastep
