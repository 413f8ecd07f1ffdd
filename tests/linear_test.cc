// (b) LoRA output and gradients against a dense autograd reference, fused and unfused;
// (c) the frozen dgrad of a [b,s,V] tensor viewed as [s,b,V] runs one 2-D GEMM (aten::mm),
// never a batched one, and matches the reference.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "lib/model/adapter.h"
#include "lib/training/grad_finalizer.h"
#include "lib/model/linear.h"
#include "lib/model/qwen2.h"
#include "lib/torch_compat.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::RelErr;
using ::lorastep::testing::TestDevice;
using ::lorastep::testing::TestDtype;
using ::lorastep::testing::Tol;

// A detached fp64 copy that requires grad (the references' leaves).
at::Tensor F64Leaf(const at::Tensor& t) { return t.detach().to(at::kDouble).requires_grad_(true); }

// Records the names of every ATen op dispatched on this thread while alive.
class OpRecorder {
 public:
  OpRecorder() {
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&OpRecorder::OnStart).scopes({at::RecordScope::FUNCTION}));
    Ops().clear();
  }
  ~OpRecorder() { at::removeCallback(handle_); }
  static std::multiset<std::string>& Ops() {
    static std::multiset<std::string> ops;
    return ops;
  }

 private:
  static std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction& fn) {
    Ops().insert(fn.name());
    return nullptr;
  }
  at::CallbackHandle handle_;
};

TEST(FrozenDgradTest, StridedViewRunsOneTwoDimensionalGemm) {
  const at::Device dev = TestDevice();
  const int64_t s = 64, b = 1, v = 256, h = 32;
  const auto opts = at::TensorOptions().device(dev).dtype(TestDtype());
  at::Tensor w = at::randn({v, h}, opts);
  // grad_output as the backward of logits.transpose(0, 1) delivers it: [b,s,V] seen as [s,b,V].
  at::Tensor g = at::randn({b, s, v}, opts).transpose(0, 1);
  ASSERT_TRUE(g.is_contiguous());  // size-1 dims hide the bad stride: exactly the trap
  at::Tensor reference = at::matmul(g.contiguous(), w);
  at::Tensor out;
  {
    OpRecorder recorder;
    out = LinearInputGrad(g, w, /*fp32=*/false);
  }
  EXPECT_EQ(OpRecorder::Ops().count("aten::mm"), 1u);
  EXPECT_EQ(OpRecorder::Ops().count("aten::bmm"), 0u);
  EXPECT_EQ(out.sizes(), reference.sizes());
  EXPECT_LT(RelErr(out, reference), Tol(1e-6));
#if LORASTEP_TORCH_AT_LEAST(2, 0)
  // Since torch 2, the unflattened matmul on this view dispatches the batched GEMM instead
  // (the seed's bug); 1.13 still folded it.
  {
    OpRecorder recorder;
    at::matmul(g, w);
  }
  EXPECT_GE(OpRecorder::Ops().count("aten::bmm"), 1u);
#endif
}

TEST(FrozenDgradTest, AutogradThroughFrozenLinearUsesTheSamePath) {
  const at::Device dev = TestDevice();
  at::Tensor w = at::randn({48, 16}, at::TensorOptions().device(dev));
  at::Tensor x = at::randn({3, 5, 16}, at::TensorOptions().device(dev)).requires_grad_(true);
  at::Tensor y = Linear(x, w, at::Tensor(), GradOptions{});
  // Backward arrives through a transpose, as in the seed.
  at::Tensor upstream = at::randn({5, 3, 48}, at::TensorOptions().device(dev));
  {
    OpRecorder recorder;
    (y.transpose(0, 1) * upstream).sum().backward();
  }
  EXPECT_EQ(OpRecorder::Ops().count("aten::bmm"), 0u);
  at::Tensor ref = at::matmul(upstream.transpose(0, 1), w);
  EXPECT_LT(RelErr(x.grad(), ref), 1e-6);
  // fp32 dgrad option: same result.
  at::Tensor x2 = x.detach().clone().requires_grad_(true);
  (Linear(x2, w, at::Tensor(), GradOptions{true, true}).transpose(0, 1) * upstream).sum().backward();
  EXPECT_LT(RelErr(x2.grad(), ref), 1e-6);
}

// A LoRA'd q_proj of a one-layer tiny model against y = W x + b + (alpha/r) B A x in autograd.
class LoraLinearTest : public ::testing::TestWithParam<bool> {};

TEST_P(LoraLinearTest, OutputAndEveryGradientMatchDenseReference) {
  const bool fused = GetParam();
  const at::Device dev = TestDevice();
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.num_hidden_layers = 1;
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.target_modules = {"q_proj", "down_proj"};
  const auto opts = at::TensorOptions().device(dev).dtype(TestDtype());
  Adapter adapter = Adapter::CreateLora(c, lora, dev, TestDtype(), 11).value();
  // B starts at zero; give it values so every gradient path is exercised.
  for (auto& p : adapter.parameters()) {
    at::NoGradGuard g;
    p.value.normal_(0, 0.1);
  }
  const LoraFactors* f = adapter.lora(0, kQProj);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(adapter.lora(0, kKProj), nullptr);
  EXPECT_EQ(adapter.parameters()[f->a].name,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  at::Tensor a = adapter.parameters()[f->a].value, b = adapter.parameters()[f->b].value;
  at::Tensor w = at::randn({c.hidden_size, c.hidden_size}, opts);
  at::Tensor x = at::randn({2, 7, c.hidden_size}, opts).requires_grad_(true);
  at::Tensor upstream = at::randn({2, 7, c.hidden_size}, opts);

  GradOptions grad{fused, false};
  const Parameter& pa = adapter.parameters()[f->a];
  const Parameter& pb = adapter.parameters()[f->b];
  at::Tensor y = Linear(x, w, at::Tensor(), grad) +
                 Linear(Linear(x, pa.value, pa.main_grad, grad), pb.value, pb.main_grad, grad) *
                     lora.scale();
  (y * upstream).sum().backward();
  ASSERT_OK(FoldLocalGradients(&adapter));

  // Dense reference in fp64 on the same (possibly bf16-rounded) values.
  at::Tensor xr = F64Leaf(x), ar = F64Leaf(a), br = F64Leaf(b);
  at::Tensor yr = at::matmul(xr, F64Leaf(w).t()) + at::matmul(at::matmul(xr, ar.t()), br.t()) * lora.scale();
  (yr * upstream.to(at::kDouble)).sum().backward();

  EXPECT_LT(RelErr(y, yr), Tol(1e-6));
  EXPECT_LT(RelErr(x.grad(), xr.grad()), Tol(1e-6));
  EXPECT_LT(RelErr(pa.main_grad, ar.grad()), Tol(1e-6));
  EXPECT_LT(RelErr(pb.main_grad, br.grad()), Tol(1e-6));
  // The fused path leaves the autograd-visible gradient empty: the real one is in main_grad.
  EXPECT_FALSE(pa.value.grad().defined());
  // A second finalization must not add anything again.
  at::Tensor before = pa.main_grad.clone();
  ASSERT_OK(FoldLocalGradients(&adapter));
  EXPECT_TRUE(at::equal(before, pa.main_grad));
}

// LoraLinear (the branch added inside the base GEMM, scale folded into GEMM alphas) with a
// bias, against the fp64 dense reference: output, input gradient and both factors' gradients
// (main_grad when fused, autograd's grad when not).
TEST_P(LoraLinearTest, OneFunctionLoraLinearMatchesDenseReference) {
  const bool fused = GetParam();
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 24, out = 40, r = 4;
  const double scale = 2.5;
  at::Tensor w = at::randn({out, in}, opts), bias = at::randn({out}, opts);
  at::Tensor a = (at::randn({r, in}, opts) * 0.3).requires_grad_(true);
  at::Tensor b = (at::randn({out, r}, opts) * 0.3).requires_grad_(true);
  at::Tensor a_grad = at::zeros({r, in}, opts.dtype(at::kFloat)), b_grad = at::zeros({out, r}, opts.dtype(at::kFloat));
  at::Tensor x = at::randn({3, 5, in}, opts).requires_grad_(true);
  at::Tensor upstream = at::randn({3, 5, out}, opts);
  for (const bool with_bias : {true, false}) {
    for (at::Tensor* t : {&x, &a, &b}) {
      if (t->grad().defined()) t->mutable_grad() = at::Tensor();
    }
    a_grad.zero_();
    b_grad.zero_();
    const at::Tensor bb = with_bias ? bias : at::Tensor();
    at::Tensor y = LoraLinear(x, w, bb, a, a_grad, b, b_grad, scale, GradOptions{fused, false});
    (y * upstream).sum().backward();
    at::Tensor xr = F64Leaf(x), ar = F64Leaf(a), br = F64Leaf(b);
    at::Tensor yr = at::matmul(xr, F64Leaf(w).t()) + at::matmul(at::matmul(xr, ar.t()), br.t()) * scale;
    if (with_bias) yr = yr + bias.to(at::kDouble);
    (yr * upstream.to(at::kDouble)).sum().backward();
    EXPECT_LT(RelErr(y, yr), Tol(1e-6)) << with_bias;
    EXPECT_LT(RelErr(x.grad(), xr.grad()), Tol(1e-6)) << with_bias;
    EXPECT_LT(RelErr(fused ? a_grad : a.grad(), ar.grad()), Tol(1e-6)) << with_bias;
    EXPECT_LT(RelErr(fused ? b_grad : b.grad(), br.grad()), Tol(1e-6)) << with_bias;
    EXPECT_EQ(a.grad().defined(), !fused);  // fused: the real gradient is in main_grad only
  }
}

// SegmentedLoraLinear over a random [1, rows, in] input, and its backward from a random
// upstream gradient: (input, upstream, output).
std::tuple<at::Tensor, at::Tensor, at::Tensor> SegmentedForwardBackward(const at::Tensor& w, const at::Tensor& bias,
                                                                        const std::vector<LoraSegment>& segments,
                                                                        int64_t rows, const at::TensorOptions& opts) {
  at::Tensor x = at::randn({1, rows, w.size(1)}, opts).requires_grad_(true);
  at::Tensor upstream = at::randn({1, rows, w.size(0)}, opts);
  at::Tensor y = SegmentedLoraLinear(x, w, bias, segments);
  (y * upstream).sum().backward();
  return {x, upstream, y};
}

// SegmentedLoraLinear against the fp64 dense reference of each segment alone: output, input
// gradient and every factor's main_grad; a segment's factors get nothing from other rows.
// Three layouts over one packed row of 1 x 24 rows: three runs of ranks 16, none and 8 (mixed
// ranks and scales, a run without a branch), two runs of rank 8 with one scale, and two runs
// of equal rows with ranks 16 and 8 (the batched route, on every device: the smaller rank's
// factors padded with zeros). On CUDA in bf16 the first two take the grouped path (two
// grouped GEMMs each way); elsewhere one GEMM pair per segment.
TEST(SegmentedLoraLinearTest, EachSegmentMatchesItsOwnDenseReference) {
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 32, out = 48;
  struct Run {
    int64_t begin, end, rank;
    double scale;
    at::Tensor a, b, a_grad, b_grad;
  };
  const std::vector<std::vector<Run>> layouts{{{0, 9, 16, 2.5}, {9, 13, 0, 0}, {13, 24, 8, 0.5}},
                                              {{0, 10, 8, 2.0}, {10, 24, 8, 2.0}},
                                              {{0, 12, 16, 2.5}, {12, 24, 8, 0.5}}};
  for (size_t l = 0; l < layouts.size(); ++l) {
    std::vector<Run> runs = layouts[l];
    at::Tensor w = at::randn({out, in}, opts), bias = at::randn({out}, opts);
    std::vector<LoraSegment> segments;
    for (Run& r : runs) {
      if (r.rank == 0) continue;
      r.a = at::randn({r.rank, in}, opts) * 0.3;
      r.b = at::randn({out, r.rank}, opts) * 0.3;
      r.a_grad = at::zeros({r.rank, in}, opts.dtype(at::kFloat));
      r.b_grad = at::zeros({out, r.rank}, opts.dtype(at::kFloat));
      segments.push_back({r.begin, r.end, r.a, r.a_grad, r.b, r.b_grad, r.scale});
    }
    const auto [x, upstream, y] = SegmentedForwardBackward(w, bias, segments, 24, opts);
    at::Tensor xr = F64Leaf(x);
    std::vector<at::Tensor> parts;
    std::vector<std::pair<at::Tensor, at::Tensor>> factors;
    for (const Run& r : runs) {
      at::Tensor xs = xr.narrow(1, r.begin, r.end - r.begin);
      at::Tensor ys = at::matmul(xs, F64Leaf(w).t()) + bias.to(at::kDouble);
      if (r.rank > 0) {
        factors.emplace_back(F64Leaf(r.a), F64Leaf(r.b));
        ys = ys + at::matmul(at::matmul(xs, factors.back().first.t()), factors.back().second.t()) * r.scale;
      }
      parts.push_back(ys);
    }
    const at::Tensor yr = at::cat(parts, 1);
    (yr * upstream.to(at::kDouble)).sum().backward();
    EXPECT_LT(RelErr(y, yr), Tol(1e-6)) << "layout " << l;
    EXPECT_LT(RelErr(x.grad(), xr.grad()), Tol(1e-6)) << "layout " << l;
    size_t f = 0;
    for (const Run& r : runs) {
      if (r.rank == 0) continue;
      EXPECT_LT(RelErr(r.a_grad, factors[f].first.grad()), Tol(1e-6)) << "layout " << l << " run at " << r.begin;
      EXPECT_LT(RelErr(r.b_grad, factors[f].second.grad()), Tol(1e-6)) << "layout " << l << " run at " << r.begin;
      ++f;
    }
  }
}

// SegmentedLoraLinear over a packed weight (three projections of 16 columns each), each
// segment's parts adding into their own columns, against the fp64 dense reference of each
// segment alone. Layouts: runs with different parts (one skipping the middle projection, one
// with a single part) and a gap row range; and two runs with the same parts and scale (on
// CUDA in bf16 the grouped path's single-concatenation form), once more with equal row counts
// (batched GEMMs for the branches, on every device). The first and last have no bias.
TEST(SegmentedLoraLinearTest, PartsAddIntoTheirOwnColumns) {
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 32, out = 48;
  struct Part {
    int64_t column, rank;
    at::Tensor a, b, a_grad, b_grad;
  };
  struct Run {
    int64_t begin, end;
    double scale;
    std::vector<Part> parts;
  };
  const std::vector<std::vector<Run>> layouts{
      {{0, 9, 2.0, {{0, 8}, {32, 16}}}, {12, 20, 0.5, {{16, 8}}}, {20, 24, 1.0, {{0, 8}, {16, 8}, {32, 8}}}},
      {{0, 10, 1.5, {{0, 8}, {16, 8}, {32, 8}}}, {10, 24, 1.5, {{0, 8}, {16, 8}, {32, 8}}}},
      {{0, 12, 1.5, {{0, 8}, {16, 8}, {32, 8}}}, {12, 24, 1.5, {{0, 8}, {16, 8}, {32, 8}}}}};
  for (size_t l = 0; l < layouts.size(); ++l) {
    std::vector<Run> runs = layouts[l];
    const bool with_bias = l == 1;  // without, the low-rank products write the output first
    at::Tensor w = at::randn({out, in}, opts), bias = with_bias ? at::randn({out}, opts) : at::Tensor();
    std::vector<LoraSegment> segments;
    for (Run& r : runs) {
      LoraSegment seg{r.begin, r.end};
      seg.scale = r.scale;
      for (Part& p : r.parts) {
        p.a = at::randn({p.rank, in}, opts) * 0.3;
        p.b = at::randn({16, p.rank}, opts) * 0.3;
        p.a_grad = at::zeros({p.rank, in}, opts.dtype(at::kFloat));
        p.b_grad = at::zeros({16, p.rank}, opts.dtype(at::kFloat));
        seg.parts.push_back({p.column, 16, p.a, p.a_grad, p.b, p.b_grad});
      }
      segments.push_back(seg);
    }
    const auto [x, upstream, y] = SegmentedForwardBackward(w, bias, segments, 24, opts);
    at::Tensor xr = F64Leaf(x);
    at::Tensor yr = at::matmul(xr, F64Leaf(w).t());
    if (with_bias) yr = yr + bias.to(at::kDouble);
    std::vector<at::Tensor> rows;  // per row range, the base plus its run's parts
    std::vector<std::pair<at::Tensor, at::Tensor>> factors;
    int64_t at_row = 0;
    for (const Run& r : runs) {
      if (r.begin > at_row) rows.push_back(yr.narrow(1, at_row, r.begin - at_row));
      at::Tensor xs = xr.narrow(1, r.begin, r.end - r.begin);
      std::vector<at::Tensor> cols;
      int64_t at_col = 0;
      for (const Part& p : r.parts) {
        if (p.column > at_col) cols.push_back(at::zeros({1, r.end - r.begin, p.column - at_col}, xr.options()));
        factors.emplace_back(F64Leaf(p.a), F64Leaf(p.b));
        cols.push_back(at::matmul(at::matmul(xs, factors.back().first.t()), factors.back().second.t()) * r.scale);
        at_col = p.column + 16;
      }
      if (at_col < out) cols.push_back(at::zeros({1, r.end - r.begin, out - at_col}, xr.options()));
      rows.push_back(yr.narrow(1, r.begin, r.end - r.begin) + at::cat(cols, 2));
      at_row = r.end;
    }
    if (at_row < 24) rows.push_back(yr.narrow(1, at_row, 24 - at_row));
    const at::Tensor want = at::cat(rows, 1);
    (want * upstream.to(at::kDouble)).sum().backward();
    EXPECT_LT(RelErr(y, want), Tol(1e-6)) << "layout " << l;
    EXPECT_LT(RelErr(x.grad(), xr.grad()), Tol(1e-6)) << "layout " << l;
    size_t f = 0;
    for (const Run& r : runs) {
      for (const Part& p : r.parts) {
        EXPECT_LT(RelErr(p.a_grad, factors[f].first.grad()), Tol(1e-6)) << "layout " << l << " part at " << p.column;
        EXPECT_LT(RelErr(p.b_grad, factors[f].second.grad()), Tol(1e-6)) << "layout " << l << " part at " << p.column;
        ++f;
      }
    }
  }
  // Parts that overlap or do not fit their columns are refused.
  const at::Tensor w = at::randn({out, in}, opts), x = at::randn({1, 4, in}, opts);
  LoraSegment bad{0, 4};
  bad.parts.push_back({0, 16, at::randn({8, in}, opts), at::zeros({8, in}), at::randn({16, 8}, opts), at::zeros({16, 8})});
  bad.parts.push_back({8, 16, at::randn({8, in}, opts), at::zeros({8, in}), at::randn({16, 8}, opts), at::zeros({16, 8})});
  EXPECT_THROW(SegmentedLoraLinear(x, w, at::Tensor(), {bad}), c10::Error);
  bad.parts.pop_back();
  bad.parts[0].b = at::randn({12, 8}, opts);
  EXPECT_THROW(SegmentedLoraLinear(x, w, at::Tensor(), {bad}), c10::Error);
}

// The input as tanh(source), rebuilt in backward; counts the rebuilds.
int tanh_rebuilds = 0;
const RecomputedInput kTanhOfSource{
    [](const at::Tensor& source) { return at::tanh(source); },
    [](const at::Tensor& source, const at::Tensor& grad_input, at::Tensor* input) {
      ++tanh_rebuilds;
      *input = at::tanh(source);
      return grad_input * (1 - *input * *input);
    }};

TEST(LoraLinearRecomputedTest, MatchesDenseReferenceAndRebuildsTheInputOnce) {
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 64, out = 8, r = 4;
  const double scale = 2.5;
  at::Tensor w = at::randn({out, in}, opts);
  at::Tensor a = at::randn({r, in}, opts) * 0.3, b = at::randn({out, r}, opts) * 0.3;
  at::Tensor a_grad = at::zeros({r, in}, opts.dtype(at::kFloat)), b_grad = at::zeros({out, r}, opts.dtype(at::kFloat));
  at::Tensor source = at::randn({3, 5, in}, opts).requires_grad_(true);
  at::Tensor upstream = at::randn({3, 5, out}, opts);
  tanh_rebuilds = 0;
  at::Tensor y = LoraLinearRecomputed(source, kTanhOfSource, w, at::Tensor(), a, a_grad, b, b_grad, scale);
  (y * upstream).sum().backward();
  EXPECT_EQ(tanh_rebuilds, 1);
  at::Tensor sr = F64Leaf(source), ar = F64Leaf(a), br = F64Leaf(b);
  at::Tensor xr = at::tanh(sr);
  at::Tensor yr = at::matmul(xr, F64Leaf(w).t()) + at::matmul(at::matmul(xr, ar.t()), br.t()) * scale;
  (yr * upstream.to(at::kDouble)).sum().backward();
  EXPECT_LT(RelErr(y, yr), Tol(1e-6));
  EXPECT_LT(RelErr(source.grad(), sr.grad()), Tol(1e-6));
  EXPECT_LT(RelErr(a_grad, ar.grad()), Tol(1e-6));
  EXPECT_LT(RelErr(b_grad, br.grad()), Tol(1e-6));
}

// SegmentedLoraLinearRecomputed over tanh(source) equals SegmentedLoraLinear over the input
// itself (output, the source's gradient through tanh, every factor's main_grad) with two
// segments of 16 rows each (on CUDA in bf16 the grouped path), and rebuilds the input once.
TEST(SegmentedLoraLinearTest, RecomputedInputMatchesTheKeptInput) {
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 32, out = 48;
  const at::Tensor w = at::randn({out, in}, opts);
  const at::Tensor source = at::randn({1, 32, in}, opts);
  const at::Tensor upstream = at::randn({1, 32, out}, opts);
  std::vector<at::Tensor> factors{at::randn({8, in}, opts) * 0.3, at::randn({out, 8}, opts) * 0.3,
                                  at::randn({16, in}, opts) * 0.3, at::randn({out, 16}, opts) * 0.3};
  std::vector<at::Tensor> outputs, source_grads, main_grads;
  for (bool recomputed : {false, true}) {
    std::vector<LoraSegment> segments;
    for (int s = 0; s < 2; ++s) {
      const at::Tensor &a = factors[2 * s], &b = factors[2 * s + 1];
      main_grads.push_back(at::zeros(a.sizes(), opts.dtype(at::kFloat)));
      main_grads.push_back(at::zeros(b.sizes(), opts.dtype(at::kFloat)));
      segments.push_back({16 * s, 16 * s + 16, a, main_grads[main_grads.size() - 2], b, main_grads.back(), 1.5 + s});
    }
    at::Tensor src = source.clone().requires_grad_(true);
    tanh_rebuilds = 0;
    const at::Tensor y = recomputed ? SegmentedLoraLinearRecomputed(src, kTanhOfSource, w, at::Tensor(), segments)
                                    : SegmentedLoraLinear(at::tanh(src), w, at::Tensor(), segments);
    (y * upstream).sum().backward();
    EXPECT_EQ(tanh_rebuilds, recomputed ? 1 : 0);
    outputs.push_back(y.detach());
    source_grads.push_back(src.grad());
  }
  EXPECT_LT(RelErr(outputs[1], outputs[0]), Tol(1e-6));
  EXPECT_LT(RelErr(source_grads[1], source_grads[0]), Tol(1e-6));
  for (size_t i = 0; i < 4; ++i) EXPECT_LT(RelErr(main_grads[4 + i], main_grads[i]), Tol(1e-6)) << "factor " << i;
}

TEST_P(LoraLinearTest, FusedAndUnfusedGiveTheSameModelGradients) {
  const at::Device dev = TestDevice();
  ModelConfig c = ModelConfigPreset("tiny").value();
  ModelWeights w = RandomModelWeights(c, 5);
  ForEachNamedTensor(w, [&](const std::string&, at::Tensor& t) { t = t.to(dev, TestDtype()); });
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 4;
  at::Tensor tokens = at::randint(0, c.vocab_size, {2, 9}, at::kLong).to(dev);
  std::vector<at::Tensor> grads[2];
  for (int fused = 0; fused < 2; ++fused) {
    Adapter adapter = Adapter::CreateLora(c, lora, dev, TestDtype(), 3).value();
    // The packed groups' A main_grads lie back to back, so each group's A gradients take one
    // GEMM (LoraLinearGroup's a_grads_joined).
    for (size_t layer = 0; layer < static_cast<size_t>(c.num_hidden_layers); ++layer) {
      for (std::vector<int> group : {std::vector<int>{kQProj, kKProj, kVProj}, std::vector<int>{kGateProj, kUpProj}}) {
        std::vector<at::Tensor> grads;
        for (int slot : group) grads.push_back(adapter.parameters()[adapter.lora(layer, slot)->a].main_grad);
        EXPECT_TRUE(AdjacentRows(grads).defined()) << layer << " " << group[0];
      }
    }
    at::manual_seed(99);  // the same nonzero B for both variants
    for (auto& p : adapter.parameters()) {
      at::NoGradGuard g;
      if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0, 0.05);
    }
    ForwardOptions options;
    options.grad.fused_wgrad = fused == 1;
    at::Tensor h = Qwen2Hidden(c, w, &adapter, tokens, options);
    h.to(at::kFloat).pow(2).sum().backward();
    ASSERT_OK(FoldLocalGradients(&adapter));
    for (auto& p : adapter.parameters()) grads[fused].push_back(p.main_grad.clone());
  }
  ASSERT_EQ(grads[0].size(), 2u * 7 * c.num_hidden_layers);
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_GT(grads[0][i].abs().sum().item<double>(), 0) << i;
    EXPECT_LT(RelErr(grads[1][i], grads[0][i]), Tol(1e-5)) << i;
  }
}

// LoraLinearGroup (three projections packed, two with a branch, a bias) against the fp64
// dense reference, for a group narrow enough to add the branches with one addmm and one
// wide enough to run them inside the base GEMM (FoldBranchIntoBaseGemm; the default folds on
// CUDA only, so the wide group is also run with the fold forced on and off). Each shape runs
// without an operand cache and with one (A main_grads then back to back in one buffer, as
// the adapter packs them, so their gradients take one GEMM); the cached run goes again after
// a factor changed in place, which must rebuild the cached operands. The wide group runs
// folded once more with its input handed over with room after it (input_has_room, as a
// norm given GroupFoldRoom leaves it): x A^T lands in that room, nothing copies x.
TEST_P(LoraLinearTest, GroupMatchesDenseReferenceFoldedOrNot) {
  const bool fused = GetParam();
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t r = 4;
  const double scale = 1.5;
  struct Shape {
    int64_t in;
    std::vector<int64_t> widths;
    bool folded;
    bool room = false;
  };
  for (const Shape& shape : {Shape{24, {16, 8, 8}, false}, Shape{8, {40, 32, 48}, true}, Shape{8, {40, 32, 48}, false},
                             Shape{8, {40, 32, 48}, true, true}}) {
    const int64_t in = shape.in, out = shape.widths[0] + shape.widths[1] + shape.widths[2];
    at::Tensor w = at::randn({out, in}, opts), bias = at::randn({out}, opts);
    GradOptions options{fused, false};
    EXPECT_EQ(FoldBranchIntoBaseGemm(w, 2 * r, options), in == 8 && w.is_cuda()) << "the default";
    options.fold_lora_b = shape.folded ? 1 : 0;
    ASSERT_EQ(FoldBranchIntoBaseGemm(w, 2 * r, options), shape.folded) << in;
    for (const bool cached : {false, true}) {
      std::vector<LoraGroupPart> parts(3);
      const at::Tensor a_grads = at::zeros({2 * r, in}, opts.dtype(at::kFloat));  // parts 0 and 2, back to back
      for (int i = 0; i < 3; ++i) {
        parts[i].width = shape.widths[i];
        if (i == 1) continue;  // the middle projection has no branch
        parts[i].a = (at::randn({r, in}, opts) * 0.3).requires_grad_(true);
        parts[i].b = (at::randn({shape.widths[i], r}, opts) * 0.3).requires_grad_(true);
        parts[i].a_main_grad = cached ? a_grads.narrow(0, i == 0 ? 0 : r, r) : at::zeros({r, in}, opts.dtype(at::kFloat));
        parts[i].b_main_grad = at::zeros({shape.widths[i], r}, opts.dtype(at::kFloat));
      }
      LoraGroupOperandCache cache;
      for (int round = 0; round < (cached ? 2 : 1); ++round) {
        const std::string what = std::string(shape.room ? "folded with room" : shape.folded ? "folded" : "addmm") + (cached ? " cached" : "") +
                                 (round == 1 ? " after an in-place update" : "");
        if (round == 1) {
          at::NoGradGuard no_grad;
          parts[2].b.add_(0.25);
          EXPECT_EQ(cache.Find(w, {parts[0].a, parts[2].a}, {parts[0].b, parts[2].b}, scale, shape.folded), nullptr);
        }
        for (int i : {0, 2}) {
          parts[i].a_main_grad.zero_();
          parts[i].b_main_grad.zero_();
          parts[i].a.mutable_grad() = at::Tensor();
          parts[i].b.mutable_grad() = at::Tensor();
        }
        if (shape.room) {
          ASSERT_EQ(GroupFoldRoom(w, parts, options), 2 * r);
          GradOptions off = options, by_device = options;
          off.fold_lora_b = 0, by_device.fold_lora_b = -1;
          EXPECT_EQ(GroupFoldRoom(w, parts, off), 0);
          EXPECT_EQ(GroupFoldRoom(w, parts, by_device), w.is_cuda() ? 2 * r : 0);
        }
        const at::Tensor buffer = at::randn({3, 5, in + (shape.room ? 2 * r : 0)}, opts);
        at::Tensor x = buffer.narrow(-1, 0, in).detach().requires_grad_(true);
        at::Tensor upstream = at::randn({3, 5, out}, opts);
        at::Tensor y = LoraLinearGroup(x, w, bias, parts, scale, options, cached ? &cache : nullptr, shape.room);
        if (shape.room) {  // the room holds x A^T of both branches
          at::NoGradGuard no_grad;
          const at::Tensor xa = at::cat({at::matmul(x, parts[0].a.t()), at::matmul(x, parts[2].a.t())}, -1);
          EXPECT_LT(RelErr(buffer.narrow(-1, in, 2 * r), xa), Tol(1e-6)) << what;
        }
        (y * upstream).sum().backward();
        if (cached) {
          EXPECT_EQ(cache.size(), 1u) << what;
          EXPECT_NE(cache.Find(w, {parts[0].a, parts[2].a}, {parts[0].b, parts[2].b}, scale, shape.folded), nullptr)
              << what;
        }

        at::Tensor xr = F64Leaf(x);
        std::vector<at::Tensor> ar(3), br(3), cols;
        int64_t col = 0;
        for (int i = 0; i < 3; ++i) {
          at::Tensor yi = at::matmul(xr, F64Leaf(w.narrow(0, col, shape.widths[i])).t());
          if (i != 1) {
            ar[i] = F64Leaf(parts[i].a);
            br[i] = F64Leaf(parts[i].b);
            yi = yi + at::matmul(at::matmul(xr, ar[i].t()), br[i].t()) * scale;
          }
          cols.push_back(yi);
          col += shape.widths[i];
        }
        at::Tensor yr = at::cat(cols, -1) + bias.to(at::kDouble);
        (yr * upstream.to(at::kDouble)).sum().backward();
        EXPECT_LT(RelErr(y, yr), Tol(1e-6)) << what;
        EXPECT_LT(RelErr(x.grad(), xr.grad()), Tol(1e-6)) << what;
        for (int i : {0, 2}) {
          EXPECT_LT(RelErr(fused ? parts[i].a_main_grad : parts[i].a.grad(), ar[i].grad()), Tol(1e-6)) << what << i;
          EXPECT_LT(RelErr(fused ? parts[i].b_main_grad : parts[i].b.grad(), br[i].grad()), Tol(1e-6)) << what << i;
        }
      }
    }
  }
}

// The fold over a weight with spare columns (as PackProjections leaves gate/up): a run's
// cached operands lie over the weight's own buffer (no copy of W) and its scaled B goes into
// the spare columns. Runs with their own caches taking turns on one weight each get their own
// branch, forward and backward, also where another run's forward wrote the spare columns
// between a run's forward and its backward; the weight's version counter never moves. A
// branch wider than the spare columns folds over a copy of W.
TEST_P(LoraLinearTest, FoldOverSpareColumnsKeepsEachRunsBranch) {
  const bool fused = GetParam();
  const auto opts = at::TensorOptions().device(TestDevice()).dtype(TestDtype());
  const int64_t in = 8, r = 4;
  const std::vector<int64_t> widths{56, 48};  // wide enough for every run to fold (FoldBranchIntoBaseGemm)
  const int64_t out = widths[0] + widths[1];
  const double scale = 1.5;
  const at::Tensor buffer = at::zeros({out, in + 2 * r}, opts);
  const at::Tensor w = buffer.narrow(1, 0, in);
  w.copy_(at::randn({out, in}, opts));
  ASSERT_EQ(SpareColumns(w), 2 * r);
  EXPECT_EQ(SpareColumns(w.contiguous()), 0);
  EXPECT_EQ(SpareColumns(buffer.narrow(0, 0, out - 1).narrow(1, 0, in)), 2 * r);
  EXPECT_EQ(SpareColumns(buffer.narrow(1, 2, in)), 0);  // the last row's spare columns would pass the buffer's end
  GradOptions options{fused, false};
  options.fold_lora_b = 1;
  struct Run {
    std::vector<LoraGroupPart> parts;
    LoraGroupOperandCache cache;
    std::vector<at::Tensor> want_a, want_b;  // fp64 reference gradients, summed over its calls
  };
  std::vector<Run> runs(3);
  for (size_t k = 0; k < runs.size(); ++k) {
    const int64_t rank = k == 2 ? 2 * r : r;  // run 2: 4r ranks in all, beyond the 2r spare columns
    for (int64_t width : widths) {
      LoraGroupPart part;
      part.width = width;
      part.a = (at::randn({rank, in}, opts) * 0.3).requires_grad_(true);
      part.b = (at::randn({width, rank}, opts) * 0.3).requires_grad_(true);
      part.a_main_grad = at::zeros({rank, in}, opts.dtype(at::kFloat));
      part.b_main_grad = at::zeros({width, rank}, opts.dtype(at::kFloat));
      runs[k].parts.push_back(part);
      runs[k].want_a.push_back(at::zeros({rank, in}, opts.dtype(at::kDouble)));  // beside the grads (CUDA too)
      runs[k].want_b.push_back(at::zeros({width, rank}, opts.dtype(at::kDouble)));
    }
  }
  // Run 0, run 1, run 0 again, run 2: every forward first, then every backward.
  const std::vector<size_t> order{0, 1, 0, 2};
  const int64_t version = w._version();
  std::vector<at::Tensor> xs, ys, upstreams;
  for (size_t call = 0; call < order.size(); ++call) {
    Run& run = runs[order[call]];
    xs.push_back(at::randn({5, in}, opts).requires_grad_(true));
    upstreams.push_back(at::randn({5, out}, opts));
    ys.push_back(LoraLinearGroup(xs.back(), w, at::Tensor(), run.parts, scale, options, &run.cache));
    at::Tensor xr = F64Leaf(xs.back());
    std::vector<at::Tensor> cols, ar, br;
    for (size_t i = 0, col = 0; i < widths.size(); col += widths[i], ++i) {
      ar.push_back(F64Leaf(run.parts[i].a));
      br.push_back(F64Leaf(run.parts[i].b));
      cols.push_back(at::matmul(xr, w.narrow(0, col, widths[i]).to(at::kDouble).t()) +
                     at::matmul(at::matmul(xr, ar[i].t()), br[i].t()) * scale);
    }
    const at::Tensor yr = at::cat(cols, -1);
    (yr * upstreams.back().to(at::kDouble)).sum().backward();
    EXPECT_LT(RelErr(ys.back(), yr), Tol(1e-6)) << "call " << call;
    for (size_t i = 0; i < widths.size(); ++i) {
      run.want_a[i] += ar[i].grad();
      run.want_b[i] += br[i].grad();
    }
  }
  for (size_t call = 0; call < order.size(); ++call) (ys[call] * upstreams[call]).sum().backward();
  EXPECT_EQ(w._version(), version);
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& run = runs[k];
    std::vector<at::Tensor> as, bs;
    for (const LoraGroupPart& part : run.parts) as.push_back(part.a), bs.push_back(part.b);
    const LoraGroupOperandCache::Entry* entry = run.cache.Find(w, as, bs, scale, /*fold=*/true);
    ASSERT_NE(entry, nullptr) << "run " << k;
    EXPECT_EQ(entry->w_cat.storage().is_alias_of(w.storage()), k != 2) << "run " << k;
    EXPECT_EQ(entry->spare_id != 0, k != 2) << "run " << k;
    for (size_t i = 0; i < widths.size(); ++i) {
      const LoraGroupPart& part = run.parts[i];
      EXPECT_LT(RelErr(fused ? part.a_main_grad : part.a.grad(), run.want_a[i]), Tol(1e-6)) << "run " << k << " part " << i;
      EXPECT_LT(RelErr(fused ? part.b_main_grad : part.b.grad(), run.want_b[i]), Tol(1e-6)) << "run " << k << " part " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FusedAndUnfused, LoraLinearTest, ::testing::Bool());

}  // namespace
}  // namespace lorastep
