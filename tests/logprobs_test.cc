// (e) Chunked log-probs/entropy equal the unchunked computation (values and gradients),
// and their peak memory is bounded by the chunk, not by tokens x vocab.
#include "lib/model/logprobs.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <memory>

#include "lib/torch_compat.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::RelErr;

// Tracks live and peak CPU allocator bytes on this thread (c10's profiler memory hook).
class PeakMemoryTracker : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void*, int64_t alloc_size, compat::MemoryTotal, compat::MemoryTotal,
                         c10::Device) override {
    live_ += alloc_size;
    peak_ = std::max(peak_, live_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t peak() const { return peak_; }
  void Reset() { peak_ = live_ = 0; }

 private:
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

struct Reference {
  at::Tensor logprobs, entropy;
};

Reference Unchunked(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets) {
  at::Tensor logits = at::matmul(h, w.t()).to(at::kFloat);
  at::Tensor logp = at::log_softmax(logits, -1);
  return {logp.gather(1, targets.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(-1)};
}

TEST(ChunkedTokenScoresTest, EqualsUnchunkedValuesAndGradients) {
  const int64_t t = 37, h = 16, v = 50;
  const auto opts = at::TensorOptions().device(::lorastep::testing::TestDevice()).dtype(
      ::lorastep::testing::TestDtype());
  using ::lorastep::testing::Tol;
  at::Tensor hidden = at::randn({t, h}, opts);
  at::Tensor w = at::randn({v, h}, opts);
  at::Tensor targets = at::randint(0, v, {t}, at::kLong).to(opts.device());
  at::Tensor upstream_lp = at::randn({t}, opts.dtype(at::kFloat)),
             upstream_ent = at::randn({t}, opts.dtype(at::kFloat));
  for (int64_t chunk : {1, 5, 37, 64}) {
    at::Tensor h1 = hidden.clone().requires_grad_(true);
    at::Tensor h2 = hidden.clone().requires_grad_(true);
    at::Tensor w1 = w.clone().requires_grad_(true);
    at::Tensor w2 = w.clone().requires_grad_(true);
    at::Tensor mg = at::zeros_like(w, at::kFloat);
    TokenScores s = ChunkedTokenScores(h1, w1, mg, targets, chunk, GradOptions{true, false});
    Reference r = Unchunked(h2, w2, targets);
    EXPECT_LT(RelErr(s.logprobs, r.logprobs), Tol(1e-6)) << chunk;
    EXPECT_LT(RelErr(s.entropy, r.entropy), Tol(1e-5)) << chunk;  // fp32: lse - E[z] vs -E[log p]
    ((s.logprobs * upstream_lp).sum() + (s.entropy * upstream_ent).sum()).backward();
    ((r.logprobs * upstream_lp).sum() + (r.entropy * upstream_ent).sum()).backward();
    EXPECT_LT(RelErr(h1.grad(), h2.grad()), Tol(1e-5)) << chunk;
    EXPECT_LT(RelErr(mg, w2.grad()), Tol(1e-5)) << chunk;  // fused LM-head gradient (full FT)
    EXPECT_FALSE(w1.grad().defined());
  }
}

TEST(ChunkedTokenScoresTest, PeakMemoryIsBoundedByTheChunk) {
  const int64_t t = 512, h = 32, v = 4096;  // full fp32 logits: 512*4096*4 = 8 MiB
  at::Tensor hidden = at::randn({t, h}).requires_grad_(true);
  at::Tensor w = at::randn({v, h});
  at::Tensor targets = at::randint(0, v, {t}, at::kLong);
  auto tracker = std::make_shared<PeakMemoryTracker>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, tracker);
  const int64_t chunk = 32;  // a chunk's logits: 32*4096*4 = 512 KiB
  TokenScores s = ChunkedTokenScores(hidden, w, at::Tensor(), targets, chunk, GradOptions{});
  (s.logprobs.sum() + s.entropy.sum()).backward();
  const int64_t chunked_peak = tracker->peak();
  tracker->Reset();
  {
    at::Tensor h2 = hidden.detach().clone().requires_grad_(true);
    Reference r = Unchunked(h2, w, targets);
    (r.logprobs.sum() + r.entropy.sum()).backward();
  }
  const int64_t full_peak = tracker->peak();
  const int64_t full_logits = t * v * 4;
  ASSERT_GT(chunked_peak, 0);  // the hook saw allocations at all
  EXPECT_GE(full_peak, full_logits);
  // A few chunk-sized temporaries (logits, probabilities, gradient) plus O(t*h) tensors.
  EXPECT_LT(chunked_peak, full_logits / 2) << "chunked " << chunked_peak << " vs full " << full_peak;
}

}  // namespace
}  // namespace lorastep

namespace lorastep {
namespace {

// With only log-probs used, backward gets no entropy gradient and must still be exact.
TEST(ChunkedTokenScoresTest, UnusedEntropyOutputNeedsNoGradient) {
  const int64_t t = 9, h = 8, v = 20;
  at::Tensor hidden = at::randn({t, h}).requires_grad_(true);
  at::Tensor w = at::randn({v, h});
  at::Tensor targets = at::randint(0, v, {t}, at::kLong);
  TokenScores s = ChunkedTokenScores(hidden, w, at::Tensor(), targets, 4, GradOptions{});
  s.logprobs.sum().backward();
  at::Tensor h2 = hidden.detach().clone().requires_grad_(true);
  at::log_softmax(at::matmul(h2, w.t()), -1).gather(1, targets.unsqueeze(1)).sum().backward();
  EXPECT_LT(::lorastep::testing::RelErr(hidden.grad(), h2.grad()), 1e-5);
}

}  // namespace
}  // namespace lorastep

namespace lorastep {
namespace {

// The frozen head (LoRA) prepares its input gradient in forward: values and gradients of
// both outputs still equal the unchunked reference, at every chunk size.
TEST(ChunkedTokenScoresTest, FrozenHeadEqualsUnchunkedValuesAndGradients) {
  for (const int64_t v : {50, 3001}) {  // under and over one CUDA block's 1024 threads per row
  SCOPED_TRACE(v);
  const int64_t t = 37, h = 16;
  const auto opts = at::TensorOptions().device(::lorastep::testing::TestDevice()).dtype(
      ::lorastep::testing::TestDtype());
  using ::lorastep::testing::RelErr;
  using ::lorastep::testing::Tol;
  at::Tensor hidden = at::randn({t, h}, opts);
  at::Tensor w = at::randn({v, h}, opts);
  at::Tensor targets = at::randint(0, v, {t}, at::kLong).to(opts.device());
  at::Tensor up_lp = at::randn({t}, opts.dtype(at::kFloat)), up_ent = at::randn({t}, opts.dtype(at::kFloat));
  for (int64_t chunk : {1, 5, 37, 64}) {
    at::Tensor h1 = hidden.clone().requires_grad_(true);
    at::Tensor h2 = hidden.clone().requires_grad_(true);
    TokenScores s = ChunkedTokenScores(h1, w, at::Tensor(), targets, chunk, GradOptions{});
    Reference r = Unchunked(h2, w, targets);
    EXPECT_LT(RelErr(s.logprobs, r.logprobs), Tol(1e-6)) << chunk;
    EXPECT_LT(RelErr(s.entropy, r.entropy), Tol(1e-5)) << chunk;
    ((s.logprobs * up_lp).sum() + (s.entropy * up_ent).sum()).backward();
    ((r.logprobs * up_lp).sum() + (r.entropy * up_ent).sum()).backward();
    EXPECT_LT(RelErr(h1.grad(), h2.grad()), Tol(1e-5)) << chunk;
  }
  }
}

// entropy_grad=false skips the entropy's [T, H] product; differentiating the entropy anyway
// is an error, not a silently wrong gradient. Without autograd nothing is prepared.
TEST(ChunkedTokenScoresTest, FrozenHeadRefusesAnUnpreparedEntropyGradient) {
  const int64_t t = 9, h = 8, v = 20;
  at::Tensor hidden = at::randn({t, h}).requires_grad_(true);
  at::Tensor w = at::randn({v, h});
  at::Tensor targets = at::randint(0, v, {t}, at::kLong);
  TokenScores s = ChunkedTokenScores(hidden, w, at::Tensor(), targets, 4, GradOptions{}, {},
                                     /*entropy_grad=*/false);
  EXPECT_THROW(s.entropy.sum().backward(), c10::Error);
  at::NoGradGuard no_grad;
  TokenScores plain = ChunkedTokenScores(hidden, w, at::Tensor(), targets, 4, GradOptions{});
  EXPECT_FALSE(plain.logprobs.requires_grad());
  EXPECT_LT(::lorastep::testing::RelErr(plain.logprobs, s.logprobs.detach()), 1e-6);
}

}  // namespace
}  // namespace lorastep
