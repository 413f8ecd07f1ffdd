// The Gated DeltaNet pieces (lib/model/gated_delta.h) against references written here: the
// gated delta rule token by token in fp64 with explicit per-head matrices (values, final state
// and every input's gradient), the causal convolution as an explicit sum per position.
#include "lib/model/gated_delta.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <array>
#include <cmath>

#include "gtest/gtest.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::RelErr;

struct Inputs {
  at::Tensor q, k, v, g, beta, state;
};

// Random operands: q, k [b, T, hk, dk], v [b, T, hv, dv], g <= 0, beta in (0, 1), a state.
Inputs RandomInputs(int64_t b, int64_t t, int64_t hk, int64_t hv, int64_t dk, int64_t dv, uint64_t seed) {
  at::manual_seed(seed);
  Inputs in;
  in.q = at::randn({b, t, hk, dk});
  in.k = at::randn({b, t, hk, dk});
  in.v = at::randn({b, t, hv, dv});
  in.g = -at::softplus(at::randn({b, t, hv})) * 0.5;
  in.beta = at::sigmoid(at::randn({b, t, hv}));
  in.state = at::randn({b, hv, dk, dv}) * 0.3;
  return in;
}

// The rule as the recurrence defines it, fp64, one head and one token at a time:
// S <- exp(g) S; S <- S + k beta (v - S^T k)^T; out = S^T q, with q, k L2-normalized
// (eps 1e-6 in the sum of squares) and q scaled by 1/sqrt(dk).
std::pair<at::Tensor, at::Tensor> Reference(const Inputs& in, bool with_state) {
  const int64_t b = in.q.size(0), t = in.q.size(1), hk = in.q.size(2), dk = in.q.size(3), hv = in.v.size(2),
                dv = in.v.size(3);
  auto d = [](const at::Tensor& x) { return x.to(at::kDouble); };
  std::vector<at::Tensor> states, outs;
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < hv; ++h) {
      const int64_t kh = h / (hv / hk);
      at::Tensor s = with_state ? d(in.state[bi][h]) : at::zeros({dk, dv}, at::kDouble);
      std::vector<at::Tensor> head_out;
      for (int64_t i = 0; i < t; ++i) {
        at::Tensor q = d(in.q[bi][i][kh]), k = d(in.k[bi][i][kh]);
        q = q / at::sqrt(q.dot(q) + 1e-6) / std::sqrt(static_cast<double>(dk));
        k = k / at::sqrt(k.dot(k) + 1e-6);
        s = s * at::exp(d(in.g[bi][i][h]));
        const at::Tensor error = d(in.v[bi][i][h]) - at::mv(s.t(), k);
        s = s + at::outer(k, error * d(in.beta[bi][i][h]));
        head_out.push_back(at::mv(s.t(), q));
      }
      outs.push_back(at::stack(head_out));  // [t, dv]
      states.push_back(s);
    }
  }
  at::Tensor out = at::stack(outs).view({b, hv, t, dv}).transpose(1, 2);
  return {out, at::stack(states).view({b, hv, dk, dv})};
}

struct Grads {
  at::Tensor out, state, dq, dk, dv, dg, dbeta, dstate;
};

// Value, final state and input gradients of sum(out * w_out) + sum(state * w_state).
template <typename Fn>
Grads Differentiate(const Inputs& in, bool with_state, const at::Tensor& w_out, const at::Tensor& w_state, Fn&& fn) {
  Inputs leaf;
  for (auto [dst, src] : {std::pair<at::Tensor*, const at::Tensor*>{&leaf.q, &in.q}, {&leaf.k, &in.k}, {&leaf.v, &in.v},
                          {&leaf.g, &in.g}, {&leaf.beta, &in.beta}, {&leaf.state, &in.state}}) {
    *dst = src->detach().clone().requires_grad_(true);
  }
  auto [out, state] = fn(leaf);
  (out.to(at::kDouble) * w_out).sum().add((state.to(at::kDouble) * w_state).sum()).backward();
  Grads g{out.detach().to(at::kDouble), state.detach().to(at::kDouble), leaf.q.grad(), leaf.k.grad(), leaf.v.grad(),
          leaf.g.grad(), leaf.beta.grad(), with_state ? leaf.state.grad() : at::Tensor()};
  return g;
}

// Chunked (several chunk sizes, a length no chunk divides, grouped value heads, with and
// without a starting state) and token-by-token: values, final states and every input's
// gradient against the fp64 recurrence.
TEST(GatedDeltaTest, ChunkedAndStepwiseEqualTheRecurrence) {
  const Inputs in = RandomInputs(2, 37, 2, 4, 8, 6, 1);
  const at::Tensor w_out = at::randn({2, 37, 4, 6}, at::kDouble), w_state = at::randn({2, 4, 8, 6}, at::kDouble);
  for (const bool with_state : {false, true}) {
    const Grads want = Differentiate(in, with_state, w_out, w_state, [&](const Inputs& x) {
      Inputs d = x;
      for (at::Tensor* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.state}) *t = t->to(at::kDouble);
      return Reference(d, with_state);
    });
    for (const int64_t chunk : {0, 1, 4, 16, 64}) {  // 0: token by token
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << (with_state ? ", from a state" : ""));
      const Grads got = Differentiate(in, with_state, w_out, w_state, [&](const Inputs& x) {
        const at::Tensor s = with_state ? x.state : at::Tensor();
        return chunk == 0 ? GatedDeltaRuleStep(x.q, x.k, x.v, x.g, x.beta, s)
                          : GatedDeltaRule(x.q, x.k, x.v, x.g, x.beta, chunk, s);
      });
      EXPECT_LT(RelErr(got.out, want.out), 1e-5);
      EXPECT_LT(RelErr(got.state, want.state), 1e-5);
      EXPECT_LT(RelErr(got.dq.to(at::kDouble), want.dq), 1e-5);
      EXPECT_LT(RelErr(got.dk.to(at::kDouble), want.dk), 1e-5);
      EXPECT_LT(RelErr(got.dv.to(at::kDouble), want.dv), 1e-5);
      EXPECT_LT(RelErr(got.dg.to(at::kDouble), want.dg), 1e-5);
      EXPECT_LT(RelErr(got.dbeta.to(at::kDouble), want.dbeta), 1e-5);
      if (with_state) {
        EXPECT_LT(RelErr(got.dstate.to(at::kDouble), want.dstate), 1e-5);
      }
    }
  }
}

// A state carried over: the rule over a prefix, then the rest from its final state, equals
// the whole sequence at once (decoding continues a prefill this way).
TEST(GatedDeltaTest, ContinuingFromAStateEqualsTheWholeSequence) {
  const Inputs in = RandomInputs(1, 20, 2, 2, 8, 8, 2);
  at::NoGradGuard no_grad;
  auto [whole, end] = GatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, 8);
  auto part = [&](const at::Tensor& x, int64_t from, int64_t n) { return x.narrow(1, from, n); };
  auto [head, mid] = GatedDeltaRule(part(in.q, 0, 13), part(in.k, 0, 13), part(in.v, 0, 13), part(in.g, 0, 13),
                                    part(in.beta, 0, 13), 8);
  std::vector<at::Tensor> tail;
  at::Tensor s = mid;
  for (int64_t t = 13; t < 20; ++t) {  // decoding, one token at a time
    auto [o, next] = GatedDeltaRuleStep(part(in.q, t, 1), part(in.k, t, 1), part(in.v, t, 1), part(in.g, t, 1),
                                        part(in.beta, t, 1), s);
    tail.push_back(o);
    s = next;
  }
  EXPECT_LT(RelErr(at::cat({head, at::cat(tail, 1)}, 1), whole), 1e-5);
  EXPECT_LT(RelErr(s, end), 1e-5);
}

// Packed rows: each sequence from a zero state, as if alone.
TEST(GatedDeltaTest, PackedSequencesRestartTheRecurrence) {
  const std::vector<int64_t> lengths = {5, 11, 3};
  const Inputs in = RandomInputs(1, 19, 1, 2, 4, 4, 3);
  at::NoGradGuard no_grad;
  const at::Tensor packed = PackedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, lengths, 4);
  int64_t start = 0;
  for (int64_t n : lengths) {
    Inputs one;
    for (auto [dst, src] : {std::pair<at::Tensor*, const at::Tensor*>{&one.q, &in.q}, {&one.k, &in.k},
                            {&one.v, &in.v}, {&one.g, &in.g}, {&one.beta, &in.beta}}) {
      *dst = src->narrow(1, start, n);
    }
    EXPECT_LT(RelErr(packed.narrow(1, start, n).to(at::kDouble), Reference(one, false).first), 1e-5) << "at " << start;
    start += n;
  }
}

// The chunk system's inverse by doubling (the rule's path with
// LORASTEP_GDN_TRIANGULAR_SOLVE=0; gated_delta_inverse_test runs this file so) against the
// triangular solve, for every chunk length up to 64 and a system shaped like the rule's
// (beta_i k_i . k_j decayed, normalized keys).
TEST(GatedDeltaTest, UnitLowerInverseEqualsTheTriangularSolve) {
  at::manual_seed(6);
  for (const int64_t c : {1, 2, 3, 5, 16, 33, 64}) {
    SCOPED_TRACE(c);
    const at::Tensor k = at::randn({3, c, 16}, at::kDouble);
    const at::Tensor kn = k / k.norm(2, -1, true);
    const at::Tensor beta = at::rand({3, c, 1}, at::kDouble);
    const at::Tensor cum = (-at::rand({3, c}, at::kDouble) * 0.1).cumsum(-1);
    const at::Tensor decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).clamp_max(0).exp();
    const at::Tensor lower = (at::matmul(kn * beta, kn.transpose(-1, -2)) * decay).tril(-1);
    const at::Tensor rhs = at::randn({3, c, 8}, at::kDouble);
    const at::Tensor want = at::linalg_solve_triangular(lower, rhs, /*upper=*/false, /*left=*/true,
                                                        /*unitriangular=*/true);
    EXPECT_LT(RelErr(at::matmul(UnitLowerInverse(lower), rhs), want), 1e-12);
    const at::Tensor fp32 = at::matmul(UnitLowerInverse(lower.to(at::kFloat)), rhs.to(at::kFloat));
    EXPECT_LT(RelErr(fp32.to(at::kDouble), want), 1e-5);
  }
}

// The causal depthwise convolution: out[t] = silu(sum_j w[:, j] x[t - K + 1 + j]), zeros before
// each sequence's start.
TEST(GatedDeltaTest, CausalConvolutionSeesOnlyItsOwnPast) {
  at::manual_seed(4);
  const int64_t channels = 6, kernel = 4;
  const at::Tensor x = at::randn({1, 12, channels}), w = at::randn({channels, kernel});
  const std::vector<int64_t> lengths = {7, 5};
  const at::Tensor got = CausalConv1dSilu(x, w, lengths), alone = CausalConv1dSilu(x.narrow(1, 0, 7), w);
  int64_t start = 0;
  for (int64_t n : lengths) {
    for (int64_t t = 0; t < n; ++t) {
      at::Tensor sum = at::zeros({channels}, at::kDouble);
      for (int64_t j = 0; j < kernel; ++j) {
        const int64_t p = t - kernel + 1 + j;
        if (p >= 0) sum += w.select(1, j).to(at::kDouble) * x[0][start + p].to(at::kDouble);
      }
      EXPECT_LT(RelErr(got[0][start + t].to(at::kDouble), sum * at::sigmoid(sum)), 1e-6) << start + t;
    }
    start += n;
  }
  EXPECT_EQ(RelErr(alone, got.narrow(1, 0, 7)), 0);
}

// Gates and the gated norm, written out.
TEST(GatedDeltaTest, GatesAndGatedNorm) {
  at::manual_seed(5);
  const at::Tensor a = at::randn({3, 4}), b = at::randn({3, 4}), a_log = at::randn({4}), dt_bias = at::randn({4});
  auto [g, beta] = GatedDeltaGates(a, b, a_log, dt_bias);
  EXPECT_LT(RelErr(g, -a_log.exp() * at::log1p(at::exp(a + dt_bias))), 1e-6);
  EXPECT_LT(RelErr(beta, 1 / (1 + at::exp(-b))), 1e-6);
  EXPECT_TRUE(g.le(0).all().item<bool>());
  const at::Tensor x = at::randn({5, 8}), z = at::randn({5, 8}), w = at::randn({8});
  const at::Tensor want = x / at::sqrt(x.pow(2).mean(-1, true) + 1e-6) * w * (z / (1 + at::exp(-z)));
  EXPECT_LT(RelErr(GatedRmsNorm(x, z, w, 1e-6), want), 1e-6);
}

// The gated norm on the test device (on CUDA its fused kernel) against the composition written
// out in transformers' order with its casts: values and the gradients of x and z. The kernel
// rounds where the composition stores, so only the row sums' order differs.
TEST(GatedDeltaTest, GatedNormOnTheTestDeviceMatchesTheComposition) {
  at::manual_seed(6);
  const auto options = at::TensorOptions().device(testing::TestDevice()).dtype(testing::TestDtype());
  const double eps = 1e-6, tol = testing::TestDtype() == at::kBFloat16 ? 1e-2 : 1e-6;
  const at::Tensor x0 = (at::randn({96, 128}) * 3).to(options), z0 = at::randn({96, 128}).to(options);
  const at::Tensor w = (at::randn({128}) * 0.5 + 1).to(options), grad = at::randn({96, 128}).to(options);
  auto run = [&](bool reference) {
    const at::Tensor x = x0.clone().requires_grad_(true), z = z0.clone().requires_grad_(true);
    at::Tensor y;
    if (reference) {
      const at::Tensor xf = x.to(at::kFloat);
      const at::Tensor normed = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
      y = ((w * normed).to(at::kFloat) * at::silu(z.to(at::kFloat))).to(x.scalar_type());
    } else {
      y = GatedRmsNorm(x, z, w, eps);
    }
    y.backward(grad);
    return std::array<at::Tensor, 3>{y.detach(), x.grad(), z.grad()};
  };
  const auto got = run(false), want = run(true);
  EXPECT_LT(RelErr(got[0], want[0]), tol);
  EXPECT_LT(RelErr(got[1], want[1]), tol);
  EXPECT_LT(RelErr(got[2], want[2]), tol);
}

// The convolution's CUDA kernel (on a CUDA test device in a build with lorastep's kernels)
// against the composition written here: ATen's depthwise convolution in the weight's type,
// then SiLU; outputs and input gradients, over several sequences, with channels that fill
// 16-byte packs and channels that do not.
TEST(GatedDeltaTest, ConvolutionKernelOnTheTestDeviceMatchesTheComposition) {
  const auto options = at::TensorOptions().device(testing::TestDevice()).dtype(testing::TestDtype());
  const double tol = testing::TestDtype() == at::kBFloat16 ? 1e-2 : 1e-6;
  for (int64_t channels : {96, 13}) {
    at::manual_seed(8);
    const int64_t sequences = 3, length = 37, taps = 4;
    const at::Tensor x0 = at::randn({sequences, length, channels}).to(options);
    const at::Tensor w = (at::randn({channels, taps}) * 0.5).to(options);
    const at::Tensor grad = at::randn({sequences, length, channels}).to(options);
    auto run = [&](bool reference) {
      const at::Tensor x = x0.clone().requires_grad_(true);
      at::Tensor y;
      if (reference) {
        const at::Tensor u = at::conv1d(x.transpose(1, 2), w.unsqueeze(1), {}, 1, taps - 1, 1, channels);
        y = at::silu(u.narrow(2, 0, length)).transpose(1, 2);
      } else {
        y = FusedCausalConv1dSilu(x, w);
        if (!y.defined()) return std::array<at::Tensor, 2>{};
      }
      y.backward(grad);
      return std::array<at::Tensor, 2>{y.detach(), x.grad()};
    };
    const auto got = run(false);
    if (!got[0].defined()) GTEST_SKIP() << "no convolution kernel for this build and device";
    const auto want = run(true);
    EXPECT_LT(RelErr(got[0], want[0]), tol) << channels << " channels";
    EXPECT_LT(RelErr(got[1], want[1]), tol) << channels << " channels";
  }
}

}  // namespace
}  // namespace lorastep
