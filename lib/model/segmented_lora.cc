// SegmentedLoraLinear: one frozen projection over a packed row shared by several runs, each
// run's LoRA branch over its own rows (co-scheduled steps). Where the build has grouped GEMMs
// the branches of every run go through two GEMMs each way (SegmentGroups); elsewhere each
// segment's branch is added into its rows in place.
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "lib/env_switch.h"
#include "lib/model/linear.h"
#include "lib/model/linear_internal.h"
#include "lib/torch_compat.h"

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/add_blocks.h"
#include "lib/kernels/kernel_launch.h"
#endif

namespace lorastep {
namespace {

using linear_internal::GradAnchor;
using linear_internal::LargeGemmOverLowRank;
using linear_internal::ShapeWithLastDim;

// The grouped form of SegmentedLoraLinear's branches: the row as consecutive groups, one per
// segment plus a zero group for any rows between or after them, so two GEMMs run every run's
// branch each way. Where the segments cover the row in equal parts the narrow-side products
// run as strided batched GEMMs (`batched_rows`, any device); else as grouped GEMMs (CUDA,
// bf16, torch >= 2.8, sizes in multiples of 8).
struct SegmentGroups {
  at::Tensor a;       // [G, r, in]: each segment's parts' A concatenated, zero rows up to the largest rank (grouped: a multiple of 8)
  at::Tensor b;       // [G, out, r]: each segment's B block-diagonal over its parts' columns, times its scale
  at::Tensor offs;    // int32 [G], cumulative row ends
  at::Tensor scales;  // float [G, 1, 1]: each group's scale (0 for a zero group)
  std::vector<int64_t> group_of;  // each segment's group
  std::vector<int64_t> ends;      // offs on the host
  std::vector<int64_t> real;      // each group's segment, -1 for a zero group
  int64_t batched_rows = 0;       // every group's rows where all are equal segments; 0: grouped GEMMs
};

// Whether equal segments take the batched route (LORASTEP_SEGMENT_BMM=0 turns it off, for A/B
// measurements against the grouped GEMMs).
bool BatchedSegmentsEnabled() {
  static const bool enabled = EnvSwitchOn("LORASTEP_SEGMENT_BMM");
  return enabled;
}

// The narrow-side products of SegmentGroups' branches. RowsTimesGroup: each group's rows of
// `left` [n, k] times its `right` [G, k, r] -> [n, r]. GroupRowsProduct: each group's rows of
// `left` [n, p] transposed times its rows of `right` [n, q] -> [G, p, q] (the factors'
// gradients). With `batched_rows` one strided batched GEMM (the cuBLAS kernels of a run's own
// plain GEMMs), else one grouped GEMM over `offs`.
at::Tensor RowsTimesGroup(const at::Tensor& left, const at::Tensor& right, const at::Tensor& offs,
                          int64_t batched_rows) {
  if (batched_rows == 0) return compat::GroupedMm(left, right, offs);
  return at::bmm(left.reshape({-1, batched_rows, left.size(1)}), right).view({left.size(0), right.size(2)});
}
at::Tensor GroupRowsProduct(const at::Tensor& left, const at::Tensor& right, const at::Tensor& offs,
                            int64_t batched_rows) {
  if (batched_rows == 0) return compat::GroupedMm(left.t(), right, offs);
  return at::bmm(left.reshape({-1, batched_rows, left.size(1)}).transpose(1, 2),
                 right.reshape({-1, batched_rows, right.size(1)}));
}

// y (+)= left @ right (+ bias): `accumulate` adds into y (beta 1), else y is written (y may be
// uninitialized). Bias only when writing.
void FrozenGemmInto(at::Tensor& y, const at::Tensor& left, const at::Tensor& right, const at::Tensor& bias,
                    bool accumulate) {
  if (accumulate) {
    y.addmm_(left, right);
  } else if (bias.defined()) {
    at::addmm_out(y, bias, left, right);
  } else {
    at::mm_out(y, left, right);
  }
}

// y = left @ right (+ bias) plus, on each group's rows (`ends`, `real` as SegmentGroups has
// them), low[rows] @ low_right[group] for low_right [G, r, N]: the wide output is never
// materialized twice. As LargeGemmOverLowRank, the low-rank products write the output first
// where the large GEMM's K is below its N (it then accumulates with beta 1 in its epilogue),
// else they accumulate after it; the groups run as one batched GEMM when every group is a
// segment's and all have the same rows, else one GEMM each (zero groups add nothing).
at::Tensor LargeGemmOverGroupedLowRank(const at::Tensor& left, const at::Tensor& right, const at::Tensor& bias,
                                       const at::Tensor& low, const at::Tensor& low_right,
                                       const std::vector<int64_t>& ends, const std::vector<int64_t>& real) {
  const int64_t n = left.size(0), width = right.size(1), groups = static_cast<int64_t>(ends.size());
  const bool low_first = left.size(1) < right.size(1) && !bias.defined();
  bool equal = true;
  for (int64_t k = 0; k < groups; ++k) equal = equal && real[k] >= 0 && ends[k] - (k == 0 ? 0 : ends[k - 1]) == ends[0];
  at::Tensor y = at::empty({n, width}, left.options());
  if (!low_first) FrozenGemmInto(y, left, right, bias, /*accumulate=*/false);
  const int beta = low_first ? 0 : 1;  // beta 0: the empty output's garbage is not read
  if (equal && groups * ends[0] == n) {
    y.view({groups, ends[0], width}).baddbmm_(low.view({groups, ends[0], low.size(1)}), low_right, beta, 1);
  } else {
    for (int64_t k = 0, begin = 0; k < groups; begin = ends[k], ++k) {
      at::Tensor rows = y.narrow(0, begin, ends[k] - begin);
      if (real[k] < 0) {
        if (low_first) rows.zero_();
        continue;
      }
      rows.addmm_(low.narrow(0, begin, ends[k] - begin), low_right[k], beta, 1);
    }
  }
  if (low_first) FrozenGemmInto(y, left, right, at::Tensor(), /*accumulate=*/true);
  return y;
}

// The groups' row ends and scales on the device. Every projection of a joint row has the
// same groups (where the runs target the same modules), so the copies are kept per thread
// for the layouts last seen instead of being made on every call; the tensors are never
// written, so reuse is safe.
std::pair<at::Tensor, at::Tensor> GroupLayoutOnDevice(const std::vector<int32_t>& ends, const std::vector<float>& scales,
                                                      const c10::Device& device) {
  using Key = std::tuple<std::vector<int32_t>, std::vector<float>, int, int>;
  thread_local std::map<Key, std::pair<at::Tensor, at::Tensor>> layouts;
  Key key{ends, scales, static_cast<int>(device.type()), static_cast<int>(device.index())};
  auto it = layouts.find(key);
  if (it != layouts.end()) return it->second;
  if (layouts.size() >= 64) layouts.clear();  // layouts of past steps
  std::pair<at::Tensor, at::Tensor> made{at::tensor(ends, at::kInt).to(device, /*non_blocking=*/true),
                                         at::tensor(scales, at::kFloat).to(device, /*non_blocking=*/true).view({-1, 1, 1})};
  layouts.emplace(std::move(key), made);
  return made;
}

int64_t SegmentRank(const LoraSegment& s) {
  int64_t rank = 0;
  for (const LoraSegmentPart& p : s.parts) rank += p.a.size(0);
  return rank;
}

// Whether two segments' parts cover the same columns with the same ranks.
bool SameParts(const LoraSegment& x, const LoraSegment& y) {
  if (x.parts.size() != y.parts.size()) return false;
  for (size_t j = 0; j < x.parts.size(); ++j) {
    const LoraSegmentPart &p = x.parts[j], &q = y.parts[j];
    if (p.column != q.column || p.width != q.width || p.a.size(0) != q.a.size(0)) return false;
  }
  return true;
}

// A segment's parts as one branch of their summed rank: A concatenated [r, in] (a view where
// the factors lie back to back, as the adapter's packed values do) and B block-diagonal
// [out, r] (unscaled; a part's own factors where one part covers every column).
std::pair<at::Tensor, at::Tensor> SegmentBranch(const LoraSegment& s, int64_t out) {
  if (s.parts.size() == 1 && s.parts[0].width == out) return {s.parts[0].a, s.parts[0].b};
  std::vector<at::Tensor> as;
  for (const LoraSegmentPart& p : s.parts) as.push_back(p.a);
  at::Tensor a = AdjacentRows(as);
  if (!a.defined()) a = at::cat(as, 0);
  at::Tensor b = at::zeros({out, a.size(0)}, s.parts[0].b.options());
  int64_t r0 = 0;
  for (const LoraSegmentPart& p : s.parts) {
    b.narrow(0, p.column, p.width).narrow(1, r0, p.a.size(0)).copy_(p.b);
    r0 += p.a.size(0);
  }
  return {a, b};
}

std::optional<SegmentGroups> GroupSegments(const at::Tensor& x2d, const at::Tensor& weight,
                                           const std::vector<LoraSegment>& segments) {
  const int64_t n = x2d.size(0), in = weight.size(1), out = weight.size(0);
  if (segments.size() < 2) return std::nullopt;
  int64_t rank = 0;
  // Back to back from the first row to the last: no zero groups. Then `uniform`: one layout of
  // parts and one scale (A is one concatenation and B one stack per part); `equal`: all of
  // one size (batched GEMMs).
  bool tiled = true, uniform = true, equal = true;
  const LoraSegment& first = segments.front();
  for (size_t i = 0; i < segments.size(); ++i) {
    const LoraSegment& s = segments[i];
    if (s.begin < (i == 0 ? 0 : segments[i - 1].end) || s.end > n || s.end < s.begin) return std::nullopt;
    tiled = tiled && s.begin == (i == 0 ? 0 : segments[i - 1].end);
    uniform = uniform && SameParts(s, first) && s.scale == first.scale;
    equal = equal && s.end - s.begin == first.end - first.begin;
    rank = std::max(rank, SegmentRank(s));
  }
  tiled = tiled && segments.back().end == n;
  const bool batched = tiled && equal && first.end > first.begin && BatchedSegmentsEnabled();
  if (!batched && !GroupedLinearAvailable(x2d, {in, out})) return std::nullopt;
  uniform = uniform && tiled && (batched || rank % 8 == 0);
  if (!batched) rank = (rank + 7) / 8 * 8;  // the grouped kernel's 16-byte rows
  SegmentGroups g;
  g.batched_rows = batched ? first.end - first.begin : 0;
  std::vector<int32_t> ends;
  std::vector<float> scales;
  std::vector<int64_t> real;  // each group's segment, -1 for a zero group
  int64_t at_row = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    if (segments[i].begin > at_row) ends.push_back(static_cast<int32_t>(segments[i].begin)), real.push_back(-1);
    g.group_of.push_back(static_cast<int64_t>(ends.size()));
    ends.push_back(static_cast<int32_t>(segments[i].end));
    real.push_back(static_cast<int64_t>(i));
    at_row = segments[i].end;
  }
  if (at_row < n) ends.push_back(static_cast<int32_t>(n)), real.push_back(-1);
  for (int64_t r : real) scales.push_back(r < 0 ? 0.0f : static_cast<float>(segments[r].scale));
  std::tie(g.offs, g.scales) = GroupLayoutOnDevice(ends, scales, x2d.device());
  g.ends.assign(ends.begin(), ends.end());
  g.real = real;
  const auto G = static_cast<int64_t>(ends.size());
  if (uniform) {
    std::vector<at::Tensor> as;
    for (const LoraSegment& s : segments) {
      for (const LoraSegmentPart& p : s.parts) as.push_back(p.a);
    }
    g.a = at::cat(as, 0).view({G, rank, in});
    if (first.parts.size() == 1 && first.parts[0].width == out) {
      std::vector<at::Tensor> bs;
      for (const LoraSegment& s : segments) bs.push_back(s.parts[0].b);
      g.b = at::stack(bs).mul_(first.scale);
      return g;
    }
    g.b = at::zeros({G, out, rank}, x2d.options());
    int64_t r0 = 0;
    for (size_t j = 0; j < first.parts.size(); ++j) {
      const LoraSegmentPart& p = first.parts[j];
      std::vector<at::Tensor> bs;
      for (const LoraSegment& s : segments) bs.push_back(s.parts[j].b);
      g.b.narrow(1, p.column, p.width).narrow(2, r0, p.a.size(0)).copy_(at::stack(bs));
      r0 += p.a.size(0);
    }
    g.b.mul_(first.scale);
    return g;
  }
  g.a = at::zeros({G, rank, in}, x2d.options());
  g.b = at::zeros({G, out, rank}, x2d.options());
  for (size_t i = 0; i < segments.size(); ++i) {
    const LoraSegment& s = segments[i];
    int64_t r0 = 0;
    for (const LoraSegmentPart& p : s.parts) {
      const int64_t r = p.a.size(0);
      g.a[g.group_of[i]].narrow(0, r0, r).copy_(p.a);
      at::Tensor b_part = g.b[g.group_of[i]].narrow(0, p.column, p.width).narrow(1, r0, r);
      at::mul_out(b_part, p.b, at::scalar_tensor(s.scale));  // a CPU scalar: no device fill
      r0 += r;
    }
  }
  return g;
}

// AddPartGrads on the GPU: one kernel for every part (CUDA build, every main_grad a contiguous
// fp32 tensor on grad_a's GPU), where the views a fused foreach add needs, several per run and
// part, cost more host time than the adds on a joint row of many runs. False where it does not
// apply (nothing added).
bool AddPartGradsOnDevice(const at::Tensor& grad_a, const at::Tensor& grad_b, const std::vector<int64_t>& group_of,
                          const std::vector<int64_t>& slots, const c10::List<at::Tensor>& a_grads,
                          const c10::List<at::Tensor>& b_grads) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (!grad_a.is_cuda() || !grad_a.is_contiguous() || !grad_b.is_contiguous() ||
      grad_a.scalar_type() != at::kFloat || grad_b.scalar_type() != at::kFloat) {
    return false;
  }
  const size_t parts = slots.size() / 5;
  std::vector<at::Tensor> targets;  // held until the launch
  targets.reserve(2 * parts);
  for (size_t k = 0; k < parts; ++k) {
    for (const at::Tensor& t : {a_grads.get(k), b_grads.get(k)}) {
      if (!t.is_contiguous() || t.scalar_type() != at::kFloat || t.device() != grad_a.device()) return false;
      targets.push_back(t);
    }
  }
  const int64_t ranks = grad_a.size(1), in = grad_a.size(2), out = grad_b.size(1);
  const at::Tensor table = kernels::HostTable(static_cast<int64_t>(parts) * 2 * kernels::kAddBlockFields);
  int64_t* e = table.data_ptr<int64_t>();
  const float* a_base = grad_a.data_ptr<float>();
  const float* b_base = grad_b.data_ptr<float>();
  auto address = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  int64_t largest = 0;
  for (size_t k = 0; k < parts; ++k) {
    const int64_t group = group_of[slots[5 * k]], column = slots[5 * k + 1], width = slots[5 * k + 2];
    const int64_t r0 = slots[5 * k + 3], r = slots[5 * k + 4];
    const int64_t a_block[] = {address(targets[2 * k].data_ptr()), address(a_base + (group * ranks + r0) * in), r, in,
                               in};
    const int64_t b_block[] = {address(targets[2 * k + 1].data_ptr()),
                               address(b_base + (group * out + column) * ranks + r0), width, r, ranks};
    e = std::copy(std::begin(a_block), std::end(a_block), e);
    e = std::copy(std::begin(b_block), std::end(b_block), e);
    largest = std::max({largest, r * in, width * r});
  }
  const at::Tensor on_device = table.to(grad_a.device(), /*non_blocking=*/true);
  kernels::KernelLaunch launch(grad_a);
  kernels::CheckLaunch(kernels::LaunchAddBlocks(on_device.data_ptr<int64_t>(), static_cast<int64_t>(parts) * 2,
                                                largest, launch.stream),
                       "add blocks");
  return true;
#else
  (void)grad_a, (void)grad_b, (void)group_of, (void)slots, (void)a_grads, (void)b_grads;
  return false;
#endif
}

// Adds each part's factor gradients (its group's rows of grad_a [G, R, in] and block of grad_b
// [G, out, R], fp32) into the part's main_grads. `slots` as SegmentedLoraLinearFunction keeps
// them (segment, column, width, first rank row, rank per part).
void AddPartGrads(const at::Tensor& grad_a, const at::Tensor& grad_b, const std::vector<int64_t>& group_of,
                  const std::vector<int64_t>& slots, const c10::List<at::Tensor>& a_grads,
                  const c10::List<at::Tensor>& b_grads) {
  if (AddPartGradsOnDevice(grad_a, grad_b, group_of, slots, a_grads, b_grads)) return;
  // Each part layout's B gradients over every group made contiguous once, so that every value
  // below is contiguous like its target and _foreach_add_ runs its fused kernels instead of one
  // add per part.
  std::map<std::array<int64_t, 4>, at::Tensor> b_blocks;
  std::vector<at::Tensor> targets, values;
  for (size_t k = 0; k < slots.size() / 5; ++k) {
    const int64_t group = group_of[slots[5 * k]], r0 = slots[5 * k + 3], r = slots[5 * k + 4];
    const std::array<int64_t, 4> layout{slots[5 * k + 1], slots[5 * k + 2], r0, r};
    auto block = b_blocks.find(layout);
    if (block == b_blocks.end()) {
      block = b_blocks.emplace(layout, grad_b.narrow(1, layout[0], layout[1]).narrow(2, r0, r).contiguous()).first;
    }
    targets.insert(targets.end(), {a_grads.get(k), b_grads.get(k)});
    values.push_back(grad_a[group].narrow(0, r0, r));
    values.push_back(block->second[group]);
  }
  if (!targets.empty()) at::_foreach_add_(targets, values);
}

// x W^T (+ bias) over every row, then each segment's branch on its own rows: where the
// segments form groups (GroupSegments), x A^T for every segment as one GEMM and the wide
// products (the branch's output, backward's input gradient) added inside the output's own
// GEMMs (LargeGemmOverGroupedLowRank); elsewhere added into its rows in place (1 + 2 GEMMs per
// segment forward, 1 + 2 + 2 per part backward). No full-size temporaries. Segments ride as
// plain values, each with its parts (SegmentedLoraLinear fills them); `anchor` is what
// requires grad.
//
// With a RecomputedInput (its forward defined) the function's input is the input's source:
// forward keeps the source instead of the input, and backward rebuilds the input after the
// input gradient (as LoraLinearRecomputed does for one run).
class SegmentedLoraLinearFunction : public torch::autograd::Function<SegmentedLoraLinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& source, const at::Tensor& anchor,
                            const at::Tensor& weight, MainGradRef bias_ref, std::vector<LoraSegment> segments,
                            RecomputedInput input) {
    (void)anchor;
    const at::Tensor& bias = bias_ref.tensor;
    const at::Tensor x = input.forward != nullptr ? input.forward(source) : source;
    const at::Tensor x2d = FoldLeadingDims(x);
    ctx->saved_data["rebuild_forward"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(input.forward));
    ctx->saved_data["rebuild"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(input.backward));
    const at::Tensor kept = input.forward != nullptr ? source : x2d;  // saved first
    std::vector<int64_t> bounds, part_slots;  // per part: segment, column, width, first rank row, rank
    std::vector<double> scales;
    c10::List<at::Tensor> a_grads, b_grads;  // per part
    for (size_t i = 0; i < segments.size(); ++i) {
      const LoraSegment& s = segments[i];
      bounds.insert(bounds.end(), {s.begin, s.end});
      scales.push_back(s.scale);
      int64_t r0 = 0;
      for (const LoraSegmentPart& p : s.parts) {
        part_slots.insert(part_slots.end(), {static_cast<int64_t>(i), p.column, p.width, r0, p.a.size(0)});
        r0 += p.a.size(0);
        a_grads.push_back(p.a_main_grad);
        b_grads.push_back(p.b_main_grad);
      }
    }
    ctx->saved_data["bounds"] = bounds;
    ctx->saved_data["part_slots"] = part_slots;
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["a_grads"] = a_grads;
    ctx->saved_data["b_grads"] = b_grads;
    if (std::optional<SegmentGroups> g = GroupSegments(x2d, weight, segments)) {
      const at::Tensor xa = RowsTimesGroup(x2d, g->a.transpose(1, 2), g->offs, g->batched_rows);  // [n, r]
      const at::Tensor y =
          LargeGemmOverGroupedLowRank(x2d, weight.t(), bias, xa, g->b.transpose(1, 2), g->ends, g->real);
      ctx->saved_data["group_of"] = g->group_of;
      ctx->saved_data["group_rows"] = g->batched_rows;
      ctx->saved_data["group_ends"] = g->ends;
      ctx->saved_data["group_real"] = g->real;
      ctx->save_for_backward({kept, weight, xa, g->a, g->b, g->offs, g->scales});
      return y.view(ShapeWithLastDim(x, weight.size(0)));
    }
    at::Tensor y = bias.defined() ? at::addmm(bias, x2d, weight.t()) : at::mm(x2d, weight.t());
    std::vector<at::Tensor> saved{kept, weight};
    for (const LoraSegment& s : segments) {
      const int64_t rows = s.end - s.begin;
      const auto [a, b] = SegmentBranch(s, weight.size(0));
      const at::Tensor xa = at::mm(x2d.narrow(0, s.begin, rows), a.t());
      y.narrow(0, s.begin, rows).addmm_(xa, b.t(), /*beta=*/1, /*alpha=*/s.scale);
      saved.insert(saved.end(), {xa, a, b});
    }
    ctx->save_for_backward(saved);
    return y.view(ShapeWithLastDim(x, weight.size(0)));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const std::vector<int64_t> bounds = ctx->saved_data["bounds"].toIntVector();
    const std::vector<int64_t> slots = ctx->saved_data["part_slots"].toIntVector();
    const std::vector<double> scales = ctx->saved_data["scales"].toDoubleVector();
    const c10::List<at::Tensor> a_grads = ctx->saved_data["a_grads"].toTensorList();
    const c10::List<at::Tensor> b_grads = ctx->saved_data["b_grads"].toTensorList();
    const auto rebuild_forward = reinterpret_cast<decltype(RecomputedInput::forward)>(
        static_cast<intptr_t>(ctx->saved_data["rebuild_forward"].toInt()));
    const auto rebuild = reinterpret_cast<decltype(RecomputedInput::backward)>(
        static_cast<intptr_t>(ctx->saved_data["rebuild"].toInt()));
    const at::Tensor g = FoldLeadingDims(grads[0]).contiguous();
    const bool input_grad = ctx->needs_input_grad(0);
    const size_t parts = slots.size() / 5;
    auto slot = [&](size_t k, int field) { return slots[5 * k + field]; };  // segment, column, width, r0, rank
    const bool grouped = ctx->saved_data.count("group_of") != 0;
    // The input gradient first (it needs no input), then the input itself: saved, or rebuilt
    // from its source together with the source's gradient.
    at::Tensor grad_x, gb;
    std::vector<at::Tensor> segment_gbs;  // per segment, d(xa) / scale (the per-segment form)
    if (grouped) {
      const at::Tensor &a = saved[3], &b = saved[4], &offs = saved[5];
      gb = RowsTimesGroup(g, b, offs, ctx->saved_data["group_rows"].toInt());  // d(xa): the scale is in b
      if (input_grad) {
        grad_x = LargeGemmOverGroupedLowRank(g, weight, at::Tensor(), gb, a, ctx->saved_data["group_ends"].toIntVector(),
                                             ctx->saved_data["group_real"].toIntVector());
      }
    } else {
      if (input_grad) grad_x = at::mm(g, weight);
      for (size_t i = 0; i < scales.size(); ++i) {
        const int64_t begin = bounds[2 * i], rows = bounds[2 * i + 1] - begin;
        const at::Tensor &a = saved[3 + 3 * i], &b = saved[4 + 3 * i];
        segment_gbs.push_back(at::mm(g.narrow(0, begin, rows), b));
        if (input_grad) grad_x.narrow(0, begin, rows).addmm_(segment_gbs.back(), a, /*beta=*/1, /*alpha=*/scales[i]);
      }
    }
    at::Tensor grad_input = input_grad ? grad_x.view(ShapeWithLastDim(grads[0], weight.size(1))) : at::Tensor();
    at::Tensor x2d = saved[0];
    if (rebuild_forward != nullptr) {  // saved[0] is the source
      at::Tensor x;
      if (input_grad) {
        grad_input = rebuild(saved[0], grad_input, &x);
      } else {
        x = rebuild_forward(saved[0]);
      }
      x2d = FoldLeadingDims(x);
    }
    if (grouped) {
      const std::vector<int64_t> group_of = ctx->saved_data["group_of"].toIntVector();
      const at::Tensor &xa = saved[2], &offs = saved[5], &group_scales = saved[6];
      // Each group's factor gradients (in x's dtype, the kernels' output), to fp32 and scaled.
      const int64_t rows = ctx->saved_data["group_rows"].toInt();
      const at::Tensor grad_b = GroupRowsProduct(g, xa, offs, rows).to(at::kFloat).mul_(group_scales);
      const at::Tensor grad_a = GroupRowsProduct(gb, x2d, offs, rows).to(at::kFloat);
      AddPartGrads(grad_a, grad_b, group_of, slots, a_grads, b_grads);
    } else {
      for (size_t i = 0, k = 0; i < scales.size(); ++i) {
        const int64_t begin = bounds[2 * i], rows = bounds[2 * i + 1] - begin;
        const at::Tensor& xa = saved[2 + 3 * i];
        const at::Tensor gs = g.narrow(0, begin, rows), xs = x2d.narrow(0, begin, rows);
        for (; k < parts && slot(k, 0) == static_cast<int64_t>(i); ++k) {
          const int64_t r0 = slot(k, 3), r = slot(k, 4);
          at::Tensor a_grad = a_grads.get(k), b_grad = b_grads.get(k);
          compat::AddMatmulFp32(b_grad, gs.narrow(1, slot(k, 1), slot(k, 2)).t(), xa.narrow(1, r0, r), scales[i]);
          compat::AddMatmulFp32(a_grad, segment_gbs[i].narrow(1, r0, r).t(), xs, scales[i]);
        }
      }
    }
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor SegmentedLoraLinearRecomputed(const at::Tensor& source, const RecomputedInput& input,
                                         const at::Tensor& weight, const at::Tensor& bias,
                                         std::vector<LoraSegment> segments) {
  for (LoraSegment& s : segments) {  // one projection's factors: one part over every column
    if (s.parts.empty()) s.parts.push_back({0, weight.size(0), s.a, s.a_main_grad, s.b, s.b_main_grad});
    int64_t next = 0;  // parts in column order, apart, inside the weight's rows, factors to fit
    for (const LoraSegmentPart& p : s.parts) {
      TORCH_CHECK(p.column >= next && p.width > 0 && p.column + p.width <= weight.size(0) && p.a.dim() == 2 &&
                      p.a.size(1) == weight.size(1) && p.b.dim() == 2 && p.b.size(0) == p.width &&
                      p.b.size(1) == p.a.size(0),
                  "SegmentedLoraLinear: a part's columns or factors do not fit the weight");
      next = p.column + p.width;
    }
  }
  return SegmentedLoraLinearFunction::apply(source, GradAnchor(source.device()), weight, MainGradRef{bias},
                                            std::move(segments), input);
}

at::Tensor SegmentedLoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               std::vector<LoraSegment> segments) {
  return SegmentedLoraLinearRecomputed(x, RecomputedInput{nullptr, nullptr}, weight, bias, std::move(segments));
}

}  // namespace lorastep
