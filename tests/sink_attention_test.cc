// Attention sinks through a kernel's log-sum-exp (lib/model/sink_attention.h) against the
// explicit mask with a sink column (compat::SinkCausalAttention): outputs and the gradients
// of q, k, v and the sinks. On CPU in fp64 through a dense kernel written here with flash
// attention's contract (its backward forms the softmax gradient from the row sums of dO * O
// it is given), which checks the algebra; on a CUDA test device in bf16 through the flash
// varlen kernel itself, over packed sequences.
#include "lib/model/sink_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "lib/torch_compat.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using testing::RelErr;
using testing::TestDevice;
using testing::TestDtype;

// Dense causal attention of one sequence, token-major, with flash attention's contract.
class DenseLseKernel : public LseAttentionKernel {
 public:
  explicit DenseLseKernel(int64_t window) : window_(window) {}

  std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) override {
    const at::Tensor scores = Scores(q, k);                      // [heads, t, t]
    const at::Tensor lse = at::logsumexp(scores, -1);            // [heads, t]
    const at::Tensor probs = at::exp(scores - lse.unsqueeze(-1));
    return {at::matmul(probs, Heads(v, q.size(1))).transpose(0, 1), lse};
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> Backward(const at::Tensor& grad, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& out, const at::Tensor& lse) override {
    const int64_t heads = q.size(1), kv = k.size(1), d = q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const at::Tensor p = at::exp(Scores(q, k) - lse.unsqueeze(-1));  // recomputed from the kernel's statistics
    const at::Tensor dout = grad.transpose(0, 1), o = out.transpose(0, 1);  // [heads, t, d]
    const at::Tensor dv = at::matmul(p.transpose(1, 2), dout);
    const at::Tensor dp = at::matmul(dout, Heads(v, heads).transpose(1, 2));
    const at::Tensor row = (dout * o).sum(-1, /*keepdim=*/true);  // the kernel's D
    const at::Tensor ds = p * (dp - row) * scale;
    const at::Tensor dq = at::matmul(ds, Heads(k, heads));
    const at::Tensor dk = at::matmul(ds.transpose(1, 2), q.transpose(0, 1));
    auto per_kv = [&](const at::Tensor& x) {  // [heads, t, d] -> [t, kv, d], summed over each group
      return x.reshape({kv, heads / kv, x.size(1), d}).sum(1).transpose(0, 1);
    };
    return {dq.transpose(0, 1), per_kv(dk), per_kv(dv)};
  }

 private:
  // [t, kv, d] -> [heads, t, d], each key/value head serving its group of query heads.
  static at::Tensor Heads(const at::Tensor& x, int64_t heads) {
    return x.transpose(0, 1).repeat_interleave(heads / x.size(1), 0);
  }
  at::Tensor Scores(const at::Tensor& q, const at::Tensor& k) const {
    const int64_t t = q.size(0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
    const at::Tensor s = at::matmul(q.transpose(0, 1), Heads(k, q.size(1)).transpose(1, 2)) * scale;
    return s.masked_fill(compat::CausalMask(t, window_, q.device()).logical_not(), -std::numeric_limits<double>::infinity());
  }
  int64_t window_;
};

struct Grads {
  at::Tensor out, dq, dk, dv, dsinks;
};

// Output and gradients (for a fixed random output gradient) of `attend` over leaf copies.
template <typename Attend>
Grads OutputAndGrads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks,
          const at::Tensor& grad, Attend attend) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& x : {q, k, v, sinks}) leaves.push_back(x.detach().clone().requires_grad_(true));
  const at::Tensor out = attend(leaves[0], leaves[1], leaves[2], leaves[3]);
  const auto g = torch::autograd::grad({out}, leaves, {grad});
  return {out.detach(), g[0], g[1], g[2], g[3]};
}

// Token-major inputs of one sequence through the explicit mask ([1, heads, t, d] layout).
at::Tensor Masked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks,
                  int64_t window) {
  auto rows = [](const at::Tensor& x) { return x.transpose(0, 1).unsqueeze(0); };
  return compat::SinkCausalAttention(rows(q), rows(k), rows(v), window, sinks)[0].transpose(0, 1);
}

TEST(SinkAttentionTest, ThroughTheLogSumExpEqualsTheExplicitMaskAndItsGradients) {
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  for (int64_t window : {0, 5}) {
    for (int64_t kv : {4, 2}) {  // plain and grouped heads
      at::manual_seed(3);
      const int64_t t = 13, heads = 4, d = 8;
      const at::Tensor q = at::randn({t, heads, d}, opt), k = at::randn({t, kv, d}, opt);
      const at::Tensor v = at::randn({t, kv, d}, opt), sinks = at::randn({heads}, opt) * 2;
      const at::Tensor grad = at::randn({t, heads, d}, opt);
      const Grads want = OutputAndGrads(q, k, v, sinks, grad, [&](auto q, auto k, auto v, auto s) { return Masked(q, k, v, s, window); });
      const Grads got = OutputAndGrads(q, k, v, sinks, grad, [&](auto q, auto k, auto v, auto s) {
        return SinkAttentionThroughLse(q, k, v, s, std::make_shared<DenseLseKernel>(window));
      });
      SCOPED_TRACE(::testing::Message() << "window " << window << ", kv heads " << kv);
      // The mask's path forms its scores in fp32: agreement to its rounding.
      EXPECT_LT(RelErr(got.out, want.out), 1e-6);
      EXPECT_LT(RelErr(got.dq, want.dq), 1e-6);
      EXPECT_LT(RelErr(got.dk, want.dk), 1e-6);
      EXPECT_LT(RelErr(got.dv, want.dv), 1e-6);
      EXPECT_LT(RelErr(got.dsinks, want.dsinks), 1e-6);
      // The sinks matter: without them the output differs.
      EXPECT_GT(RelErr(DenseLseKernel(window).Forward(q, k, v).first, want.out), 1e-3);
    }
  }
}

// Frozen sinks (the default): no gradient is formed for them, and q's is the one trainable
// sinks give.
TEST(SinkAttentionTest, FrozenSinksGetNoGradient) {
  const auto opt = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(5);
  const at::Tensor q = at::randn({6, 2, 4}, opt).requires_grad_(true), k = at::randn({6, 2, 4}, opt);
  const at::Tensor v = at::randn({6, 2, 4}, opt), sinks = at::randn({2}, opt);
  const at::Tensor out = SinkAttentionThroughLse(q, k, v, sinks, std::make_shared<DenseLseKernel>(0));
  out.sum().backward();
  EXPECT_TRUE(q.grad().defined());
  EXPECT_FALSE(sinks.grad().defined());
  const Grads trainable = OutputAndGrads(q, k, v, sinks, at::ones_like(out), [](auto q, auto k, auto v, auto s) {
    return SinkAttentionThroughLse(q, k, v, s, std::make_shared<DenseLseKernel>(0));
  });
  EXPECT_TRUE(at::equal(q.grad(), trainable.dq));
  EXPECT_TRUE(trainable.dsinks.defined());
}

// A padded per-sequence log-sum-exp read back by token: token t of sequence j is padded[j, :, t - start_j].
TEST(SinkAttentionTest, PaddedLogSumExpReadsBackByToken) {
  const std::vector<int32_t> cu = {0, 3, 4, 9};
  const int64_t heads = 2, longest = 5, total = 9;
  const at::Tensor padded = at::arange(3 * heads * longest, at::kFloat).reshape({3, heads, longest});
  const at::Tensor got = PaddedLseByToken(padded, at::tensor(cu, at::TensorOptions().dtype(at::kInt)), total);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{heads, total}));
  for (int64_t j = 0; j < 3; ++j) {
    for (int64_t t = cu[j]; t < cu[j + 1]; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        EXPECT_EQ(got[h][t].item<float>(), padded[j][h][t - cu[j]].item<float>()) << j << " " << t << " " << h;
      }
    }
  }
}

// The flash varlen kernel itself (CUDA, bf16/fp16), over sequences packed back to back,
// against each sequence through the explicit mask in fp32 from the same rounded inputs.
TEST(SinkAttentionTest, FlashKernelOnPackedRowsMatchesTheMask) {
  const at::Device device = TestDevice();
  const auto opt = at::TensorOptions().dtype(TestDtype()).device(device);
  if (!compat::HasVarlenAttention(at::empty({1, 1, 64}, opt))) {
    GTEST_SKIP() << "no flash varlen kernel for this device and dtype";
  }
  const std::vector<int64_t> lengths = {37, 128, 5, 300};
  int64_t total = 0, longest = 0;
  std::vector<int32_t> cu = {0};
  for (int64_t n : lengths) total += n, longest = std::max(longest, n), cu.push_back(static_cast<int32_t>(total));
  const at::Tensor cu_seqlens = at::tensor(cu, at::TensorOptions().dtype(at::kInt)).to(device);
  for (int64_t window : {0, 64}) {
    at::manual_seed(11);
    const int64_t heads = 8, kv = 2, d = 64;
    const at::Tensor q = at::randn({total, heads, d}, opt), k = at::randn({total, kv, d}, opt);
    const at::Tensor v = at::randn({total, kv, d}, opt), sinks = at::randn({heads}, opt);
    const at::Tensor grad = at::randn({total, heads, d}, opt);
    const Grads got = OutputAndGrads(q, k, v, sinks, grad, [&](auto q, auto k, auto v, auto s) {
      return SinkAttentionThroughLse(q, k, v, s, VarlenFlashLseKernel(cu_seqlens, longest, window));
    });
    auto wide = [](const at::Tensor& x) { return x.to(at::kFloat); };
    const Grads want = OutputAndGrads(wide(q), wide(k), wide(v), wide(sinks), wide(grad), [&](auto q, auto k, auto v, auto s) {
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < lengths.size(); ++i) {
        const int64_t start = cu[i], n = lengths[i];
        parts.push_back(Masked(q.narrow(0, start, n), k.narrow(0, start, n), v.narrow(0, start, n), s, window));
      }
      return at::cat(parts, 0);
    });
    SCOPED_TRACE(::testing::Message() << "window " << window);
    EXPECT_LT(RelErr(wide(got.out), want.out), 1e-2);
    EXPECT_LT(RelErr(wide(got.dq), want.dq), 2e-2);
    EXPECT_LT(RelErr(wide(got.dk), want.dk), 2e-2);
    EXPECT_LT(RelErr(wide(got.dv), want.dv), 2e-2);
    EXPECT_LT(RelErr(wide(got.dsinks), want.dsinks), 2e-2);
  }
}

}  // namespace
}  // namespace lorastep
