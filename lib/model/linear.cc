#include "lib/model/linear.h"
#include "lib/model/linear_internal.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lib/env_switch.h"
#include "lib/torch_compat.h"

namespace lorastep {
namespace linear_internal {

std::vector<int64_t> ShapeWithLastDim(const at::Tensor& t, int64_t last) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = last;
  return shape;
}

// A leaf that requires grad, one per device, passed to the LoRA functions; on the fused path
// it stands in for their factors: autograd still records each function (even over a frozen input), with one
// edge to this one AccumulateGrad node instead of one per factor that backward would visit
// only to drop an undefined gradient (1,344 visits per LoRA step on the 0.5B shape). Never
// freed: a device tensor must not outlive its runtime at exit.
const at::Tensor& GradAnchor(const at::Device& device) {
  static std::mutex mu;
  static auto* anchors = new std::map<std::string, at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& anchor = (*anchors)[device.str()];
  if (!anchor.defined()) anchor = at::zeros({}, at::TensorOptions().device(device)).requires_grad_(true);
  return anchor;
}

// left @ right + (bias) + alpha * (low @ low_right) for a small inner size of `low` (a LoRA
// rank). Where the output is wider than the large GEMM's inner size (q/k/v's forward,
// down_proj's input gradient), the low-rank GEMM goes first into a fresh output and the
// large GEMM's epilogue adds into it: a low-rank GEMM adding into the output is bound by a
// read-modify-write pass over it, which costs most there. Elsewhere the large GEMM writes
// alone and the low-rank one adds, which keeps the large GEMM's faster write-only epilogue.
at::Tensor LargeGemmOverLowRank(const at::Tensor& left, const at::Tensor& right, const at::Tensor& bias,
                                const at::Tensor& low, const at::Tensor& low_right, double alpha) {
  if (left.size(1) >= right.size(1)) {
    at::Tensor y = bias.defined() ? at::addmm(bias, left, right) : at::mm(left, right);
    return y.addmm_(low, low_right, /*beta=*/1, /*alpha=*/alpha);
  }
  at::Tensor y;
  if (bias.defined()) {
    y = at::addmm(bias, low, low_right, /*beta=*/1, /*alpha=*/alpha);
  } else {
    y = at::empty({low.size(0), low_right.size(1)}, low.options());
    y.addmm_(low, low_right, /*beta=*/0, /*alpha=*/alpha);  // beta 0: y's garbage is not read
  }
  return y.addmm_(left, right);
}

}  // namespace linear_internal

namespace {

using linear_internal::GradAnchor;
using linear_internal::LargeGemmOverLowRank;
using linear_internal::ShapeWithLastDim;

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, MainGradRef main_grad_ref, bool fused,
                            bool fp32_dgrad) {
    const at::Tensor& main_grad = main_grad_ref.tensor;
    const bool trainable = main_grad.defined();
    ctx->saved_data["trainable"] = trainable;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["fp32_dgrad"] = fp32_dgrad;
    if (trainable) ctx->saved_data["main_grad"] = main_grad;
    // x is only needed for the weight gradient; frozen layers keep just the weight.
    ctx->save_for_backward({trainable ? x : at::Tensor(), weight});
    at::Tensor y = at::mm(FoldLeadingDims(x), weight.t());
    return y.view(ShapeWithLastDim(x, weight.size(0)));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad_output = grads[0];
    at::Tensor grad_x, grad_w;
    if (ctx->needs_input_grad(0)) {
      grad_x = LinearInputGrad(grad_output, weight, ctx->saved_data["fp32_dgrad"].toBool());
    }
    if (ctx->saved_data["trainable"].toBool()) {
      at::Tensor g2d = FoldLeadingDims(grad_output);
      at::Tensor x2d = FoldLeadingDims(x);
      if (ctx->saved_data["fused"].toBool()) {
        at::Tensor main_grad = ctx->saved_data["main_grad"].toTensor();
        compat::AddMatmulFp32(main_grad, g2d.t(), x2d);
      } else {
        grad_w = at::mm(g2d.t(), x2d);
      }
    }
    return {grad_x, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// y = x2d W^T (+ bias) + scale * (x2d A^T) B^T, and x2d A^T (kept for B's gradient).
std::pair<at::Tensor, at::Tensor> LoraForward(const at::Tensor& x2d, const at::Tensor& weight, const at::Tensor& bias,
                                              const at::Tensor& a, const at::Tensor& b, double scale) {
  at::Tensor xa = at::mm(x2d, a.t());
  return {LargeGemmOverLowRank(x2d, weight.t(), bias, xa, b.t(), scale), xa};
}

// The factors' gradients of LoraForward added into their fp32 main_grads, for the output
// gradient g and gb = g B.
void AddLoraFactorGrads(at::Tensor& a_grad, at::Tensor& b_grad, const at::Tensor& g, const at::Tensor& gb,
                        const at::Tensor& xa, const at::Tensor& x2d, double scale) {
  compat::AddMatmulFp32(b_grad, g.t(), xa, scale);
  compat::AddMatmulFp32(a_grad, gb.t(), x2d, scale);
}

// y = x W^T (+ bias) + scale * (x A^T) B^T with frozen W (LoraForward), and backward folds
// `scale` into the GEMMs' alpha, so a LoRA linear runs 3 GEMMs forward and 5 backward with no
// elementwise kernels.
class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  // factors_in: {a, b} as autograd inputs (unfused, so autograd routes their gradients),
  // else empty: `anchor` (GradAnchor) is then what requires grad; a/b: the factors' values.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor,
                            at::TensorList factors_in, const at::Tensor& weight,
                            MainGradRef bias_ref, MainGradRef a_ref, MainGradRef b_ref, MainGradRef a_grad,
                            MainGradRef b_grad, double scale, bool fused) {
    (void)anchor, (void)factors_in;
    const at::Tensor& bias = bias_ref.tensor;  // frozen, possibly undefined: not an autograd input
    const at::Tensor &a = a_ref.tensor, &b = b_ref.tensor;
    at::Tensor x2d = FoldLeadingDims(x);
    auto [y, xa] = LoraForward(x2d, weight, bias, a, b, scale);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["fused"] = fused;
    if (fused) {
      ctx->saved_data["a_grad"] = a_grad.tensor;
      ctx->saved_data["b_grad"] = b_grad.tensor;
    }
    ctx->save_for_backward({x2d, xa, a, b, weight});
    return y.view(ShapeWithLastDim(x, weight.size(0)));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x2d = saved[0], &xa = saved[1], &a = saved[2], &b = saved[3], &weight = saved[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor g = FoldLeadingDims(grads[0]);
    at::Tensor gb = at::mm(g, b);  // d(xa) / scale
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_x = LargeGemmOverLowRank(g, weight, at::Tensor(), gb, a, scale).view(ShapeWithLastDim(grads[0], weight.size(1)));
    }
    at::Tensor grad_a, grad_b;
    if (ctx->saved_data["fused"].toBool()) {
      at::Tensor a_grad = ctx->saved_data["a_grad"].toTensor(), b_grad = ctx->saved_data["b_grad"].toTensor();
      AddLoraFactorGrads(a_grad, b_grad, g, gb, xa, x2d, scale);
    } else {
      grad_b = at::mm(g.t(), xa).mul_(scale);
      grad_a = at::mm(gb.t(), x2d).mul_(scale);
    }
    torch::autograd::variable_list out{grad_x, at::Tensor()};
    if (grad_a.defined()) out.insert(out.end(), {grad_a, grad_b});
    out.resize(out.size() + 9);  // weight, bias, a, b, their main_grads, scale, fused
    return out;
  }
};

// LoraLinearFunction over an input rebuilt in backward (LoraLinearRecomputed): forward keeps
// the source, x A^T and the operands; backward computes the input gradient first, then the
// source's gradient and the input again in one pass, then the factors' gradients.
class LoraLinearRecomputedFunction : public torch::autograd::Function<LoraLinearRecomputedFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& source, const at::Tensor& anchor,
                            RecomputedInput input, const at::Tensor& weight, MainGradRef bias_ref, MainGradRef a_ref,
                            MainGradRef b_ref, MainGradRef a_grad, MainGradRef b_grad, double scale) {
    (void)anchor;
    const at::Tensor& bias = bias_ref.tensor;
    const at::Tensor &a = a_ref.tensor, &b = b_ref.tensor;
    const at::Tensor x = input.forward(source);
    auto [y, xa] = LoraForward(FoldLeadingDims(x), weight, bias, a, b, scale);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["a_grad"] = a_grad.tensor;
    ctx->saved_data["b_grad"] = b_grad.tensor;
    ctx->saved_data["rebuild"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(input.backward));
    ctx->save_for_backward({source, xa, a, b, weight});
    return y.view(ShapeWithLastDim(x, weight.size(0)));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &source = saved[0], &xa = saved[1], &a = saved[2], &b = saved[3], &weight = saved[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto rebuild = reinterpret_cast<decltype(RecomputedInput::backward)>(
        static_cast<intptr_t>(ctx->saved_data["rebuild"].toInt()));
    const at::Tensor g = FoldLeadingDims(grads[0]);
    const at::Tensor gb = at::mm(g, b);  // d(xa) / scale
    const at::Tensor grad_x =
        LargeGemmOverLowRank(g, weight, at::Tensor(), gb, a, scale).view(ShapeWithLastDim(grads[0], weight.size(1)));
    at::Tensor x;
    at::Tensor grad_source = rebuild(source, grad_x, &x);
    at::Tensor a_grad = ctx->saved_data["a_grad"].toTensor(), b_grad = ctx->saved_data["b_grad"].toTensor();
    AddLoraFactorGrads(a_grad, b_grad, g, gb, xa, FoldLeadingDims(x), scale);
    torch::autograd::variable_list out{grad_source.view(source.sizes())};
    out.resize(10);  // anchor, input, weight, bias, a, b, their main_grads, scale
    return out;
  }
};

// The parts' factors and main_grads ride as plain values; on the unfused path the factors
// also ride as two tensor lists, so autograd sees each as an input and routes its gradient.
struct LoraGroupMeta {
  std::vector<int64_t> widths;     // every part's output columns
  std::vector<int> lora_parts;     // the parts with a LoRA branch, in order
  std::vector<at::Tensor> as, bs, a_grads, b_grads;
};

std::vector<int64_t> ColumnStarts(const std::vector<int64_t>& widths) {
  std::vector<int64_t> col(widths.size(), 0);
  for (size_t i = 1; i < widths.size(); ++i) col[i] = col[i - 1] + widths[i - 1];
  return col;
}

// The parameter-only operands of one group (see LoraGroupOperandCache), built from its
// factors: A concatenated (a view when they lie back to back), scale * B block-diagonal, and
// for the fold [W | scale * B_blockdiag]: over the weight's buffer where its spare columns
// hold the branch (b_blockdiag then its own tensor), else a copy of W with b_blockdiag a
// view of its right columns.
LoraGroupOperandCache::Entry BuildGroupOperands(const at::Tensor& weight, at::TensorList as, at::TensorList bs,
                                                const LoraGroupMeta& meta, double scale, bool fold) {
  LoraGroupOperandCache::Entry e;
  e.fold = fold;
  e.scale = scale;
  const std::vector<at::Tensor> a_list(as.begin(), as.end());
  e.a_cat = AdjacentRows(a_list);
  if (!e.a_cat.defined()) e.a_cat = as.size() == 1 ? as[0] : at::cat(as, 0);  // [sum r, in]
  e.a_grads_joined = AdjacentRows(meta.a_grads);
  const int64_t in = weight.size(1), out = weight.size(0), rank_sum = e.a_cat.size(0);
  if (fold && SpareColumns(weight) >= rank_sum) {
    // [W | scale * B] over the weight's own buffer, B written into its spare columns before
    // each use (UseSpareColumns). A fresh alias, not a view: writing B then leaves the
    // weight's version counter alone (autograd checks the weight it saved).
    e.w_cat = at::empty({0}, weight.options());
    e.w_cat.set_(weight.storage(), weight.storage_offset(), {out, in + rank_sum}, {weight.stride(0), 1});
    e.b_blockdiag = at::empty({out, rank_sum}, weight.options());
    static std::atomic<uint64_t> last_id{0};
    e.spare_id = ++last_id;
  } else if (fold) {
    e.w_cat = at::empty({out, in + rank_sum}, weight.options());
    e.w_cat.narrow(1, 0, in).copy_(weight);
    e.b_blockdiag = e.w_cat.narrow(1, in, rank_sum);
  } else {
    e.b_blockdiag = at::empty({out, rank_sum}, weight.options());
  }
  e.b_blockdiag.zero_();
  const std::vector<int64_t> col = ColumnStarts(meta.widths);
  int64_t r0 = 0;
  for (size_t j = 0; j < bs.size(); ++j) {
    const int part = meta.lora_parts[j];
    const int64_t r = bs[j].size(1);
    e.b_blockdiag.narrow(0, col[part], meta.widths[part]).narrow(1, r0, r).copy_(bs[j]);
    r0 += r;
  }
  e.b_blockdiag.mul_(scale);
  for (const at::Tensor& t : as) e.versions.emplace_back(t.unsafeGetTensorImpl(), t._version());
  for (const at::Tensor& t : bs) e.versions.emplace_back(t.unsafeGetTensorImpl(), t._version());
  return e;
}

// Makes the spare columns of `entry`'s weight hold its scale * B (entry.w_cat's right
// columns). Which entry wrote a weight's spare columns last is kept per weight buffer, so
// a run's calls write its B once per call while runs take turns on one base, whatever
// their order; the writes and the GEMMs that read them follow each other on the device's
// stream, as the base's calls run one at a time.
void UseSpareColumns(const LoraGroupOperandCache::Entry& entry) {
  static std::mutex mu;
  static std::unordered_map<const void*, uint64_t> written_by;
  const int64_t rank_sum = entry.b_blockdiag.size(1), in = entry.w_cat.size(1) - rank_sum;
  std::lock_guard<std::mutex> lock(mu);
  uint64_t& last = written_by[entry.w_cat.data_ptr()];
  if (last == entry.spare_id) return;
  entry.w_cat.narrow(1, in, rank_sum).copy_(entry.b_blockdiag);
  last = entry.spare_id;
}

// y = x W^T (+ bias) + scale * (x A_i^T) B_i^T into each part's columns, as
//   fold:     [x | x A_cat^T] @ [W | scale * B_blockdiag]^T, one GEMM (the wide output is
//             written once, not re-read and re-written by each branch);
//   otherwise x W^T and (x A_cat^T) (scale * B_blockdiag)^T for all branches (LargeGemmOverLowRank).
// Backward: d(xa) = g (scale * B_blockdiag) for all parts in one GEMM, the input gradient in
// two, the A factors' gradients in one when their main_grads lie back to back.
class LoraLinearGroupFunction : public torch::autograd::Function<LoraLinearGroupFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor,
                            at::TensorList as_in, at::TensorList bs_in, const at::Tensor& weight,
                            MainGradRef bias_ref, const LoraGroupMeta& meta, double scale, bool fused, bool fold,
                            LoraGroupOperandCache* cache, bool input_has_room) {
    (void)anchor, (void)as_in, (void)bs_in;
    const at::Tensor& bias = bias_ref.tensor;
    const at::TensorList as(meta.as), bs(meta.bs);
    at::Tensor x2d = FoldLeadingDims(x);
    LoraGroupOperandCache::Entry local;
    const LoraGroupOperandCache::Entry* ops = nullptr;
    if (cache != nullptr) ops = cache->Find(weight, as, bs, scale, fold);
    if (ops == nullptr) {
      local = BuildGroupOperands(weight, as, bs, meta, scale, fold);
      ops = cache != nullptr ? &cache->Put(weight, std::move(local)) : &local;
    }
    const int64_t in = weight.size(1), rank_sum = ops->a_cat.size(0);
    at::Tensor xa, y;
    if (fold) {
      if (ops->spare_id != 0) UseSpareColumns(*ops);
      // The input's own buffer where the caller left room after it (input_has_room), else a
      // copy. Over a detached alias: the views this forward writes through and saves are then
      // not autograd views of the input.
      const bool room = input_has_room && x2d.stride(1) == 1 && x2d.stride(0) == in + rank_sum;
      at::Tensor x_cat = room ? x2d.detach().as_strided({x2d.size(0), in + rank_sum}, {in + rank_sum, 1})
                              : at::empty({x2d.size(0), in + rank_sum}, x2d.options());
      if (!room) x_cat.narrow(1, 0, in).copy_(x2d);
      xa = x_cat.narrow(1, in, rank_sum);
      at::mm_out(xa, x2d, ops->a_cat.t());
      y = bias.defined() ? at::addmm(bias, x_cat, ops->w_cat.t()) : at::mm(x_cat, ops->w_cat.t());
      x2d = x_cat.narrow(1, 0, in);  // saved instead of x: the copy is kept anyway (xa beside it)
    } else {
      xa = at::mm(x2d, ops->a_cat.t());
      y = LargeGemmOverLowRank(x2d, weight.t(), bias, xa, ops->b_blockdiag.t(), 1.0);
    }
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["widths"] = meta.widths;
    ctx->saved_data["lora_parts"] = std::vector<int64_t>(meta.lora_parts.begin(), meta.lora_parts.end());
    std::vector<int64_t> ranks;
    for (const at::Tensor& b : bs) ranks.push_back(b.size(1));
    ctx->saved_data["ranks"] = ranks;
    if (fused) {
      ctx->saved_data["a_grads"] = meta.a_grads;
      ctx->saved_data["a_grads_joined"] = ops->a_grads_joined;
      ctx->saved_data["b_grads"] = meta.b_grads;
    }
    // Without a cache the fold's B block (a view of its copy of W) is copied out, so
    // backward does not keep all of [W | B] alive per micro-batch.
    const at::Tensor b_blockdiag =
        cache == nullptr && fold && ops->spare_id == 0 ? ops->b_blockdiag.clone() : ops->b_blockdiag;
    ctx->save_for_backward({x2d, xa, ops->a_cat, weight, b_blockdiag});
    return y.view(ShapeWithLastDim(x, weight.size(0)));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x2d = saved[0], &xa = saved[1], &a_cat = saved[2], &weight = saved[3], &b_blockdiag = saved[4];
    const std::vector<int64_t> widths = ctx->saved_data["widths"].toIntVector();
    const std::vector<int64_t> lora_parts = ctx->saved_data["lora_parts"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool fused = ctx->saved_data["fused"].toBool();
    const size_t k = lora_parts.size();
    const std::vector<int64_t> col = ColumnStarts(widths);
    at::Tensor g = FoldLeadingDims(grads[0]).contiguous();
    // scale * d(xa), all parts side by side: [n, sum r]. (Not one GEMM over [W | scale * B]
    // giving g W and d(xa) together: its odd column count tiles worse on a GPU.)
    const at::Tensor gb = at::mm(g, b_blockdiag);
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_x = LargeGemmOverLowRank(g, weight, at::Tensor(), gb, a_cat, 1.0).view(ShapeWithLastDim(grads[0], weight.size(1)));
    }
    const std::vector<int64_t> ranks = ctx->saved_data["ranks"].toIntVector();
    std::vector<at::Tensor> g_parts(k), gb_parts(k), xa_parts(k);
    for (size_t j = 0, r0 = 0; j < k; r0 += ranks[j], ++j) {
      g_parts[j] = g.narrow(1, col[lora_parts[j]], widths[lora_parts[j]]);
      gb_parts[j] = gb.narrow(1, r0, ranks[j]);
      xa_parts[j] = xa.narrow(1, r0, ranks[j]);
    }
    std::vector<at::Tensor> a_grads, b_grads;
    if (fused) {
      a_grads = ctx->saved_data["a_grads"].toTensorVector();
      b_grads = ctx->saved_data["b_grads"].toTensorVector();
    }
    torch::autograd::variable_list out{grad_x, at::Tensor()};
    std::vector<at::Tensor> grad_as(fused ? 0 : k), grad_bs(fused ? 0 : k);
    if (fused) {
      at::Tensor a_joined = ctx->saved_data["a_grads_joined"].toTensor();
      if (a_joined.defined()) {
        compat::AddMatmulFp32(a_joined, gb.t(), x2d);
      } else {
        for (size_t j = 0; j < k; ++j) compat::AddMatmulFp32(a_grads[j], gb_parts[j].t(), x2d);
      }
      for (size_t j = 0; j < k; ++j) compat::AddMatmulFp32(b_grads[j], g_parts[j].t(), xa_parts[j], scale);
    } else {
      for (size_t j = 0; j < k; ++j) {
        grad_as[j] = at::mm(gb_parts[j].t(), x2d);
        grad_bs[j] = at::mm(g_parts[j].t(), xa_parts[j]).mul_(scale);
      }
    }
    out.insert(out.end(), grad_as.begin(), grad_as.end());
    out.insert(out.end(), grad_bs.begin(), grad_bs.end());
    out.resize(out.size() + 8);  // weight, bias, meta, scale, fused, fold, cache, input_has_room
    return out;
  }
};

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, MainGradRef main_grad_ref, const at::Tensor& offs,
                            bool fused) {
    const at::Tensor& main_grad = main_grad_ref.tensor;
    const bool trainable = main_grad.defined();
    ctx->saved_data["trainable"] = trainable;
    ctx->saved_data["fused"] = fused;
    if (trainable) ctx->saved_data["main_grad"] = main_grad;
    ctx->save_for_backward({trainable ? x : at::Tensor(), weight, offs});
    return compat::GroupedMm(x, weight.transpose(1, 2), offs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& offs = saved[2];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor grad_x, grad_w;
    if (ctx->needs_input_grad(0)) grad_x = compat::GroupedMm(g, weight, offs);
    if (ctx->saved_data["trainable"].toBool()) {
      // [E, out, in]: each expert's g^T x over its rows (offsets along the contraction).
      at::Tensor w = compat::GroupedMm(g.t(), x, offs);
      if (ctx->saved_data["fused"].toBool()) {
        ctx->saved_data["main_grad"].toTensor().add_(w);
      } else {
        grad_w = w;
      }
    }
    return {grad_x, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class PermuteRowsFunction : public torch::autograd::Function<PermuteRowsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& perm, const at::Tensor& inverse) {
    ctx->save_for_backward({inverse});
    return x.index_select(0, perm);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0].index_select(0, ctx->get_saved_variables()[0]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor PermuteRows(const at::Tensor& x, const at::Tensor& perm, const at::Tensor& inverse) {
  return PermuteRowsFunction::apply(x, perm, inverse);
}

at::Tensor GroupedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& main_grad,
                         const at::Tensor& offs, const GradOptions& options) {
  return GroupedLinearFunction::apply(x, weight, MainGradRef{main_grad}, offs, options.fused_wgrad);
}

bool GroupedLinearAvailable(const at::Tensor& x, const std::vector<int64_t>& sizes) {
  if (!compat::HasGroupedMm(x)) return false;
  for (int64_t n : sizes) {
    if (n % 8 != 0) return false;
  }
  return true;
}

namespace {

// Whether the fold is on for this weight's device: options.fold_lora_b, else CUDA's default.
bool FoldEnabled(const at::Tensor& weight, const GradOptions& options) {
  if (options.fold_lora_b >= 0) return options.fold_lora_b == 1;
  static const bool cuda_default = EnvSwitchOn("LORASTEP_FOLD_LORA_B");
  return weight.is_cuda() && cuda_default;
}

}  // namespace

bool FoldBranchIntoBaseGemm(const at::Tensor& weight, int64_t rank_sum, const GradOptions& options) {
  return weight.size(0) >= 4 * (weight.size(1) + rank_sum) && FoldEnabled(weight, options);
}

at::Tensor FoldLeadingDims(const at::Tensor& x) { return x.reshape({-1, x.size(-1)}); }

at::Tensor LinearInputGrad(const at::Tensor& grad_output, const at::Tensor& weight, bool fp32) {
  at::Tensor g2d = FoldLeadingDims(grad_output);
  at::Tensor out = fp32 ? at::mm(g2d.to(at::kFloat), weight.to(at::kFloat)).to(grad_output.scalar_type())
                        : at::mm(g2d, weight);
  return out.view(ShapeWithLastDim(grad_output, weight.size(1)));
}

at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& a, const at::Tensor& a_main_grad, const at::Tensor& b,
                      const at::Tensor& b_main_grad, double scale, const GradOptions& options) {
  const bool fused = options.fused_wgrad;
  std::vector<at::Tensor> factors_in;
  if (!fused) factors_in = {a, b};
  return LoraLinearFunction::apply(x, GradAnchor(x.device()), at::TensorList(factors_in), weight, MainGradRef{bias},
                                   MainGradRef{a}, MainGradRef{b}, MainGradRef{a_main_grad}, MainGradRef{b_main_grad},
                                   scale, fused);
}

at::Tensor LoraLinearRecomputed(const at::Tensor& source, const RecomputedInput& input, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& a, const at::Tensor& a_main_grad,
                                const at::Tensor& b, const at::Tensor& b_main_grad, double scale) {
  return LoraLinearRecomputedFunction::apply(source, GradAnchor(source.device()), input, weight, MainGradRef{bias},
                                             MainGradRef{a}, MainGradRef{b}, MainGradRef{a_main_grad},
                                             MainGradRef{b_main_grad}, scale);
}

const LoraGroupOperandCache::Entry* LoraGroupOperandCache::Find(const at::Tensor& weight, at::TensorList as,
                                                               at::TensorList bs, double scale, bool fold) const {
  for (const auto& [key, e] : entries_) {
    if (key != weight.data_ptr()) continue;
    if (e.fold != fold || e.scale != scale || e.versions.size() != as.size() + bs.size()) return nullptr;
    size_t i = 0;
    for (at::TensorList list : {as, bs}) {
        for (const at::Tensor& t : list) {
        if (e.versions[i] != std::make_pair<const void*, int64_t>(t.unsafeGetTensorImpl(), t._version())) return nullptr;
        ++i;
      }
    }
    return &e;
  }
  return nullptr;
}

const LoraGroupOperandCache::Entry& LoraGroupOperandCache::Put(const at::Tensor& weight, Entry entry) {
  for (auto& [key, e] : entries_) {
    if (key == weight.data_ptr()) return e = std::move(entry);
  }
  entries_.emplace_back(weight.data_ptr(), std::move(entry));
  return entries_.back().second;
}

at::Tensor LoraLinearGroup(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const std::vector<LoraGroupPart>& parts, double scale, const GradOptions& options,
                           LoraGroupOperandCache* cache, bool input_has_room) {
  LoraGroupMeta meta;
  for (size_t i = 0; i < parts.size(); ++i) {
    meta.widths.push_back(parts[i].width);
    if (!parts[i].a.defined()) continue;
    meta.lora_parts.push_back(static_cast<int>(i));
    meta.as.push_back(parts[i].a);
    meta.bs.push_back(parts[i].b);
    meta.a_grads.push_back(parts[i].a_main_grad);
    meta.b_grads.push_back(parts[i].b_main_grad);
  }
  if (meta.as.empty()) {  // no branch: the frozen GEMM alone
    at::Tensor y = Linear(x, weight, at::Tensor(), options);
    return bias.defined() ? y + bias : y;
  }
  int64_t rank_sum = 0;
  for (const at::Tensor& a : meta.as) rank_sum += a.size(0);
  const bool fused = options.fused_wgrad;
  const std::vector<at::Tensor> none;
  return LoraLinearGroupFunction::apply(x, GradAnchor(x.device()),
                                        at::TensorList(fused ? none : meta.as), at::TensorList(fused ? none : meta.bs),
                                        weight, MainGradRef{bias}, meta, scale, fused,
                                        FoldBranchIntoBaseGemm(weight, rank_sum, options), cache, input_has_room);
}

int64_t GroupFoldRoom(const at::Tensor& weight, const std::vector<LoraGroupPart>& parts, const GradOptions& options) {
  int64_t rank_sum = 0;
  for (const LoraGroupPart& part : parts) rank_sum += part.a.defined() ? part.a.size(0) : 0;
  return rank_sum > 0 && weight.defined() && FoldBranchIntoBaseGemm(weight, rank_sum, options) ? rank_sum : 0;
}

at::Tensor AdjacentRows(const std::vector<at::Tensor>& parts) {
  if (parts.empty() || !parts[0].defined() || parts[0].dim() == 0) return at::Tensor();
  const at::Tensor& first = parts[0];
  // Rows dense but for dim 0's stride, which may leave spare columns after each row.
  int64_t dense = 1;
  for (int64_t d = first.dim() - 1; d >= 1; --d) {
    if (first.size(d) != 1 && first.stride(d) != dense) return at::Tensor();
    dense *= first.size(d);
  }
  if (first.stride(0) < dense) return at::Tensor();
  int64_t rows = 0;
  for (const at::Tensor& p : parts) {
    if (!p.defined() || p.dim() != first.dim() || p.sizes().slice(1) != first.sizes().slice(1) ||
        p.strides() != first.strides() ||
        p.scalar_type() != first.scalar_type() || p.device() != first.device() ||
        !p.storage().is_alias_of(first.storage()) || p.storage_offset() != first.storage_offset() + rows * first.stride(0)) {
      return at::Tensor();
    }
    rows += p.size(0);
  }
  std::vector<int64_t> sizes(first.sizes().begin(), first.sizes().end());
  sizes[0] = rows;
  return first.as_strided(sizes, first.strides());
}

int64_t SpareColumns(const at::Tensor& weight) {
  if (!weight.defined() || weight.dim() != 2 || weight.size(0) == 0 || weight.stride(1) != 1 ||
      weight.stride(0) <= weight.size(1)) {
    return 0;
  }
  const int64_t spare = weight.stride(0) - weight.size(1);
  const int64_t end = weight.storage_offset() + (weight.size(0) - 1) * weight.stride(0) + weight.size(1) + spare;
  return end * static_cast<int64_t>(weight.element_size()) <= static_cast<int64_t>(weight.storage().nbytes()) ? spare : 0;
}

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& main_grad,
                  const GradOptions& options) {
  return LinearFunction::apply(x, weight, MainGradRef{main_grad}, options.fused_wgrad, options.fp32_dgrad);
}

}  // namespace lorastep
