// Linear layers whose backward never dispatches a batched GEMM.
//
// A frozen linear's input gradient is grad_output @ W. When grad_output is a
// [s, b, V] view of a [b, s, V] tensor, at::matmul cannot fold the leading dims by stride and
// runs one mat-vec per token (bmm), re-reading W each time; is_contiguous() cannot tell.
// Every linear here folds all leading dims into one, runs exactly one 2-D GEMM, and restores
// the shape. LoRA's A and B matmuls are linears too, so they take the same path.
//
// Trainable weights collect gradients in an fp32 `main_grad` buffer (Megatron's layout):
//  - fused:   backward's weight-gradient GEMM accumulates straight into main_grad
//             (C = A·B + 1·C with fp32 C); the autograd-visible grad is left empty.
//  - unfused: backward returns the weight gradient to autograd (param.grad), and the
//             gradient finalizer adds it into main_grad afterwards.
// Both give the same main_grad; a hook that reads only param.grad misses the fused path's
// gradient, which is in main_grad.
#ifndef LORASTEP_LIB_MODEL_LINEAR_H_
#define LORASTEP_LIB_MODEL_LINEAR_H_

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace lorastep {

struct GradOptions {
  bool fused_wgrad = true;  // accumulate weight gradients straight into main_grad
  bool fp32_dgrad = false;  // compute input gradients in fp32, then cast back
  // LoraLinearGroup's K-concatenated branches (FoldBranchIntoBaseGemm): -1 = on CUDA only,
  // 0 = never, 1 = wherever the shape qualifies.
  int fold_lora_b = -1;
};

// How custom autograd functions receive a main_grad buffer (or another tensor that gets no
// gradient, such as a frozen bias): as a plain value, not a tensor argument, so autograd
// never treats it as an input (it may be undefined, and it never receives a gradient).
struct MainGradRef {
  at::Tensor tensor;
};

// All leading dims folded into one: [..., k] -> [n, k]. A view whenever strides allow.
at::Tensor FoldLeadingDims(const at::Tensor& x);

// grad_output @ weight as one 2-D GEMM, shaped like grad_output with the last dim replaced
// by weight.size(1). With fp32 set the GEMM runs in fp32 and the result is cast back.
at::Tensor LinearInputGrad(const at::Tensor& grad_output, const at::Tensor& weight, bool fp32);

// y = x @ weight^T, differentiable in x and, when `main_grad` is defined, in weight.
// `weight` must require grad when trainable (so a node exists even if x does not).
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& main_grad,
                  const GradOptions& options);

// x @ weight^T (+ bias) + scale * (x @ a^T) @ b^T for a frozen `weight`, differentiable in
// x, a and b (a and b accumulate into their main_grads like trainable linears). Fewer
// kernels than composing Linear: the branch adds into the base output inside its GEMM.
at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& a, const at::Tensor& a_main_grad, const at::Tensor& b,
                      const at::Tensor& b_main_grad, double scale, const GradOptions& options);

// One projection's LoRA factors within a packed weight (PackProjections' q/k/v or gate/up):
// its output columns [column, column + width) and its factors (a: [r, in], b: [width, r]).
struct LoraSegmentPart {
  int64_t column = 0, width = 0;
  at::Tensor a, a_main_grad, b, b_main_grad;
};

// One run's LoRA over rows [begin, end) of a packed row shared by several runs: either one
// projection's factors (a, b over every output column) or, for a packed weight, `parts`, one
// per projection with a branch (a and b then undefined).
struct LoraSegment {
  int64_t begin = 0, end = 0;
  at::Tensor a, a_main_grad, b, b_main_grad;
  double scale = 1.0;
  std::vector<LoraSegmentPart> parts;
};

// x @ weight^T (+ bias) over every row of x's folded [n, in] view, plus on each segment's rows
// only scale * (x_s @ a^T) @ b^T, for a frozen `weight` (co-scheduling: several runs' LoRA
// over one packed row; rows in no segment get the base alone). A segment with parts adds each
// part's branch into the part's columns: its parts run as one branch of their summed rank
// (A concatenated, B block-diagonal), as LoraLinearGroup packs one run's. Differentiable in
// x; the factors accumulate into their main_grads.
at::Tensor SegmentedLoraLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               std::vector<LoraSegment> segments);

// An input that LoraLinearRecomputed keeps only as its `source` (what it is computed from,
// kept for backward anyway) and rebuilds in backward. `forward(source)` is the input;
// `backward(source, grad_input, &input)` returns the source's gradient and writes the input
// again, the same values forward computed. Plain function pointers, so autograd's context
// can hold them from forward to backward.
struct RecomputedInput {
  at::Tensor (*forward)(const at::Tensor& source);
  at::Tensor (*backward)(const at::Tensor& source, const at::Tensor& grad_input, at::Tensor* input);
};

// LoraLinear(input.forward(source), ...) differentiable in `source`, keeping `source` but not
// the input: the LoRA A factor's gradient needs the input, and backward rebuilds it after the
// input gradient. a and b accumulate into their main_grads (GradOptions::fused_wgrad).
at::Tensor LoraLinearRecomputed(const at::Tensor& source, const RecomputedInput& input, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& a, const at::Tensor& a_main_grad,
                                const at::Tensor& b, const at::Tensor& b_main_grad, double scale);

// SegmentedLoraLinear(input.forward(source), ...) differentiable in `source`, keeping `source`
// but not the input: backward rebuilds the input after the input gradient (the factors'
// gradients need it), as LoraLinearRecomputed does for one run.
at::Tensor SegmentedLoraLinearRecomputed(const at::Tensor& source, const RecomputedInput& input,
                                         const at::Tensor& weight, const at::Tensor& bias,
                                         std::vector<LoraSegment> segments);

// One part of a LoraLinearGroup: `width` output columns of the packed weight, with a LoRA
// branch when `a` is defined (a: [r, in], b: [width, r], main_grads like LoraLinear's).
struct LoraGroupPart {
  int64_t width = 0;
  at::Tensor a, a_main_grad, b, b_main_grad;
};

// Several projections of the same input as one: y = x @ weight^T (+ bias) for the parts'
// frozen weights packed back to back ([sum of widths, in]), and each part's LoRA branch
// scale * (x A_i^T) B_i^T added into its own columns. The A factors run as one GEMM
// (concatenated) and the B branches as one (block-diagonal), so q/k/v take 3 GEMMs forward
// instead of 3 x 3; backward's input gradient is two GEMMs for all parts.
//
// `cache` (optional): where the group's parameter-only operands live for the length of one
// trainer call, so its micro-batches build them once (see LoraGroupOperandCache).
// `input_has_room`: x is the left block of a buffer GroupFoldRoom(...) columns wider (as
// RmsNorm's `room` leaves it), whose right columns this call may overwrite; the fold then
// writes x A^T there and runs without copying x.
class LoraGroupOperandCache;
at::Tensor LoraLinearGroup(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const std::vector<LoraGroupPart>& parts, double scale, const GradOptions& options,
                           LoraGroupOperandCache* cache = nullptr, bool input_has_room = false);

// The columns LoraLinearGroup's fold wants free after its input, so that it runs without
// copying x: the parts' total rank where the group folds (FoldBranchIntoBaseGemm), else 0.
// Narrow groups (q/k/v) do not fold even with the copy gone: their folded GEMM with its bias
// epilogue is slower on a GPU than the plain GEMM and the branch's addmm.
int64_t GroupFoldRoom(const at::Tensor& weight, const std::vector<LoraGroupPart>& parts, const GradOptions& options);

// The operands of LoraLinearGroup that depend on the parameters only: A factors
// concatenated, scale * B block-diagonal ([sum of widths, sum of ranks], zero outside each
// part's block) and, for the fold, [W | scale * B_blockdiag]: over the weight's own buffer
// where it has the spare columns (PackProjections), else a copy of W. Building them is a handful of
// small kernels per group; without a cache every micro-batch of every layer repeats them,
// and on a GPU those launches, not its arithmetic, bound the LoRA step. Entries are keyed by the
// packed weight and rebuilt when a factor changed in place (its version counter moved), so a
// stale operand is never used; a trainer keeps one cache per call.
class LoraGroupOperandCache {
 public:
  struct Entry {
    at::Tensor a_cat, b_blockdiag, w_cat;
    at::Tensor a_grads_joined;  // the A factors' main_grads as one view, when back to back
    // Non-zero: w_cat lies over the weight's buffer and b_blockdiag is its own tensor, written
    // into the spare columns before use; the id tells this entry's writes from others'.
    uint64_t spare_id = 0;
    bool fold = false;
    double scale = 0;
    std::vector<std::pair<const void*, int64_t>> versions;  // each factor's impl and version
  };
  // The entry of `weight` if it was built from these very factors, unchanged, with the same
  // scale and fold; else null.
  const Entry* Find(const at::Tensor& weight, at::TensorList as, at::TensorList bs, double scale, bool fold) const;
  const Entry& Put(const at::Tensor& weight, Entry entry);
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::pair<const void*, Entry>> entries_;  // a few dozen groups: a flat list
};

// Whether LoraLinearGroup runs the branches inside the base GEMM, as
// [x | x A^T] @ [W | scale * B_blockdiag]^T (K-concatenated), for a packed `weight` and the
// parts' total rank. It pays on CUDA where the output is much wider than the input (gate/up
// is several times wider than the hidden size): copying x (and, where the weight has no
// spare columns, W once per call) is then far cheaper than the B addmm re-reading and
// re-writing the output. Not on CPU, where the GEMMs
// are compute-bound and the copies gain nothing. Backward is the same either way.
// LORASTEP_FOLD_LORA_B=0 switches the CUDA default off (for A/B measurements).
bool FoldBranchIntoBaseGemm(const at::Tensor& weight, int64_t rank_sum, const GradOptions& options);

// `parts` (equal trailing sizes and strides, dense but for dim 0's stride) as one tensor
// along dim 0 when they lie back to back in one buffer, as PackProjections leaves them;
// undefined otherwise.
at::Tensor AdjacentRows(const std::vector<at::Tensor>& parts);

// The columns after each row of a 2-D row-major `weight` that lie inside its storage but
// outside the weight (its row stride minus its width; 0 for a dense weight): PackProjections'
// spare columns, where a fold writes its B instead of copying W.
int64_t SpareColumns(const at::Tensor& weight);

// x.index_select(0, perm) for a permutation `perm` of x's rows, whose backward gathers with
// `inverse` (inverse[perm[i]] = i) instead of scatter-adding (no atomics: the MoE dispatch
// and combine move every token row this way).
at::Tensor PermuteRows(const at::Tensor& x, const at::Tensor& perm, const at::Tensor& inverse);

// Routed experts: rows of x grouped by expert (offs: int32 cumulative row ends, one per
// expert), y[rows of e] = x[rows of e] @ weight[e]^T, for weight [E, out, in]. One grouped
// GEMM each way (forward, input gradient, and the stacked weight gradient when `main_grad`
// [E, out, in] is defined). Needs GroupedLinearAvailable.
at::Tensor GroupedLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& main_grad,
                         const at::Tensor& offs, const GradOptions& options);
// Whether the build and device run grouped GEMMs for x's dtype (CUDA, bf16/fp16, torch >=
// 2.8) and every size is a multiple of 8 (16-byte rows); else callers loop over experts.
bool GroupedLinearAvailable(const at::Tensor& x, const std::vector<int64_t>& sizes);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LINEAR_H_
