// (d) Every loss and metric against values computed by hand in the comments.
#include "lib/training/losses.h"

#include <cmath>

#include "lib/training/batch.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;

at::Tensor T(std::vector<float> v) { return at::tensor(v, at::kFloat); }

struct Case {
  LossInputs in;
  LossDenominators den;
};

// Two positions of one sample, both loss-bearing.
Case TwoTokens(std::vector<float> lp, std::vector<float> old, std::vector<float> adv) {
  Case c;
  c.in.logprobs = T(lp).requires_grad_(true);
  c.in.entropy = T({0.5f, 1.5f});
  c.in.mask = T({1, 1});
  c.in.sample_index = at::zeros({2}, at::kLong);
  c.in.sampler_logprobs = T(old);
  c.in.advantages = T(adv);
  c.den.loss_tokens = 2;
  c.den.sample_tokens = T({2});
  c.den.samples = 1;
  return c;
}

TEST(LossesTest, CrossEntropyTokenMeanAndSum) {
  Case c = TwoTokens({-1.0f, -3.0f}, {0, 0}, {0, 0});
  c.in.advantages = at::Tensor();
  c.in.sampler_logprobs = at::Tensor();
  LossConfig cfg;
  Metrics m;
  at::Tensor loss = ComputeLoss(cfg, c.in, c.den, &m);
  EXPECT_NEAR(loss.item<double>(), 2.0, 1e-6);  // (1 + 3) / 2
  loss.backward();
  EXPECT_NEAR(c.in.logprobs.grad()[0].item<double>(), -0.5, 1e-6);
  EXPECT_NEAR(m.Get("entropy:mean"), 1.0, 1e-6);
  cfg.normalization = LossNormalization::kSum;
  Metrics m2;
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &m2).item<double>(), 4.0, 1e-6);
}

TEST(LossesTest, PpoClipBothSidesAndMetrics) {
  // ratio0 = e^{0.5} = 1.6487 (A=+1: clipped at 1.28 -> loss -1.28, clipped);
  // ratio1 = e^{-0.5} = 0.6065 (A=-1: clipped at 0.8 -> max(0.6065, 0.8) = 0.8, clipped).
  Case c = TwoTokens({0.5f, -0.5f}, {0.0f, 0.0f}, {1.0f, -1.0f});
  LossConfig cfg;
  cfg.kind = LossKind::kPpo;
  Metrics m;
  at::Tensor loss = ComputeLoss(cfg, c.in, c.den, &m);
  EXPECT_NEAR(loss.item<double>(), (-1.28 + 0.8) / 2, 1e-5);
  EXPECT_NEAR(m.Get("pg_clipfrac:mean"), 1.0, 1e-9);
  EXPECT_NEAR(m.Get("ppo_kl:mean"), 0.0, 1e-7);  // (old - lp) averaged: (-0.5 + 0.5) / 2
  loss.backward();
  // Clipped on both sides: no gradient flows through the ratio.
  EXPECT_NEAR(c.in.logprobs.grad().abs().sum().item<double>(), 0.0, 1e-9);

  // Inside the clip range: ratio = e^{0.1} = 1.10517, A = 2 -> loss -2.21034, gradient -ratio*A.
  Case in = TwoTokens({0.1f, 0.1f}, {0.0f, 0.0f}, {2.0f, 2.0f});
  Metrics m2;
  at::Tensor l2 = ComputeLoss(cfg, in.in, in.den, &m2);
  EXPECT_NEAR(l2.item<double>(), -2.0 * std::exp(0.1), 1e-5);
  EXPECT_NEAR(m2.Get("pg_clipfrac:mean"), 0.0, 1e-9);
  EXPECT_NEAR(m2.Get("ppo_kl:mean"), -0.1, 1e-6);
  l2.backward();
  EXPECT_NEAR(in.in.logprobs.grad()[0].item<double>(), -std::exp(0.1) * 2 / 2, 1e-5);
}

TEST(LossesTest, PpoDualClipBoundsNegativeAdvantages) {
  // ratio = e^{2} = 7.389, A = -1: standard PPO loss max(7.389, 0.8) = 7.389;
  // dual clip c = 3 caps it at -c*A = 3.
  Case c = TwoTokens({2.0f, 2.0f}, {0.0f, 0.0f}, {-1.0f, -1.0f});
  LossConfig cfg;
  cfg.kind = LossKind::kPpo;
  Metrics plain;
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &plain).item<double>(), std::exp(2.0), 1e-4);
  cfg.dual_clip_c = 3.0;
  Metrics m;
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &m).item<double>(), 3.0, 1e-6);
  EXPECT_NEAR(m.Get("pg_clipfrac_lower:mean"), 1.0, 1e-9);
  // Exactly at the dual-clip edge (ratio = 3 -> loss 3 = bound): not counted as clipped.
  Case edge = TwoTokens({static_cast<float>(std::log(3.0)), 0.0f}, {0.0f, 0.0f}, {-1.0f, 1.0f});
  Metrics me;
  ComputeLoss(cfg, edge.in, edge.den, &me);
  EXPECT_NEAR(me.Get("pg_clipfrac_lower:mean"), 0.0, 1e-9);
}

TEST(LossesTest, ImportanceSamplingAndCispo) {
  Case c = TwoTokens({0.2f, -0.1f}, {0.0f, 0.0f}, {1.0f, 3.0f});
  LossConfig cfg;
  cfg.kind = LossKind::kImportanceSampling;
  Metrics m;
  // -(e^{0.2}*1 + e^{-0.1}*3) / 2
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &m).item<double>(),
              -(std::exp(0.2) + 3 * std::exp(-0.1)) / 2, 1e-5);
  cfg.kind = LossKind::kCispo;
  cfg.cispo_ratio_low = 0.95;
  cfg.cispo_ratio_high = 1.1;
  Metrics mc;
  // weights: clamp(e^{0.2}=1.2214 -> 1.1), clamp(e^{-0.1}=0.9048 -> 0.95)
  // loss = -(1.1 * 0.2 * 1 + 0.95 * -0.1 * 3) / 2
  at::Tensor loss = ComputeLoss(cfg, c.in, c.den, &mc);
  EXPECT_NEAR(loss.item<double>(), -(1.1 * 0.2 + 0.95 * -0.3) / 2, 1e-5);
  EXPECT_NEAR(mc.Get("pg_clipfrac:mean"), 1.0, 1e-9);
  loss.backward();
  // The weight is stop-gradient: d/dlp = -w*A/2.
  EXPECT_NEAR(c.in.logprobs.grad()[0].item<double>(), -1.1 / 2, 1e-5);
  EXPECT_NEAR(c.in.logprobs.grad()[1].item<double>(), -0.95 * 3 / 2, 1e-5);
}

// DRO against its formula written out in fp64 over random positions: per position
// -(lp * A - beta / 2 * (lp - old)^2), summed (Tinker's loss:sum), and the gradient
// -(A - beta * (lp - old)); the penalty metric; beta 0 is the plain advantage-weighted loss.
TEST(LossesTest, DroMatchesItsFormulaAndGradient) {
  at::manual_seed(5);
  const int64_t n = 64;
  for (double beta : {0.05, 0.7, 0.0}) {
    LossInputs in;
    in.logprobs = (-at::rand({n}, at::kFloat) * 3).requires_grad_(true);
    in.sampler_logprobs = -at::rand({n}, at::kFloat) * 3;
    in.advantages = at::randn({n}, at::kFloat);
    in.entropy = at::zeros({n}, at::kFloat);
    in.mask = (at::rand({n}) > 0.2).to(at::kFloat);
    in.sample_index = at::zeros({n}, at::kLong);
    LossDenominators den;
    den.loss_tokens = in.mask.sum().item<double>();
    den.sample_tokens = in.mask.sum().reshape({1});
    den.samples = 1;
    LossConfig cfg;
    cfg.kind = LossKind::kDro;
    cfg.dro_beta = beta;
    cfg.normalization = LossNormalization::kSum;
    ASSERT_OK(ValidateLossConfig(cfg));
    Metrics m;
    at::Tensor loss = ComputeLoss(cfg, in, den, &m);
    loss.backward();
    const at::Tensor lp = in.logprobs.detach().to(at::kDouble), old = in.sampler_logprobs.to(at::kDouble);
    const at::Tensor a = in.advantages.to(at::kDouble), mask = in.mask.to(at::kDouble);
    double want = 0, penalty = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (mask[i].item<double>() == 0) continue;
      const double d = lp[i].item<double>() - old[i].item<double>();
      want += -(lp[i].item<double>() * a[i].item<double>() - beta / 2 * d * d);
      penalty += d * d / 2;
      EXPECT_NEAR(in.logprobs.grad()[i].item<double>(), -(a[i].item<double>() - beta * d), 1e-5) << i;
    }
    EXPECT_NEAR(loss.item<double>(), want, 1e-4 * std::max(1.0, std::abs(want))) << "beta " << beta;
    EXPECT_NEAR(m.Get("loss:sum"), want, 1e-4 * std::max(1.0, std::abs(want)));
    EXPECT_NEAR(m.Get("dro_penalty:mean"), penalty / den.loss_tokens, 1e-5);
  }
  EXPECT_EQ(ParseLossKind("dro").value(), LossKind::kDro);
  EXPECT_STREQ(LossKindName(LossKind::kDro), "dro");
  LossConfig bad;
  bad.dro_beta = -0.1;
  EXPECT_THAT(ValidateLossConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument, "loss.dro_beta"));
  bad.dro_beta = NAN;
  EXPECT_THAT(ValidateLossConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument, "loss.dro_beta"));
  bad.dro_beta = 1e30;
  EXPECT_THAT(ValidateLossConfig(bad), StatusIs(absl::StatusCode::kInvalidArgument, "loss.dro_beta"));
}

TEST(LossesTest, TruncatedImportanceSamplingAndMismatchMetrics) {
  // trainer old = lp (no old_logprobs): w = exp(lp - sampler) = e^{1} (capped at 2), e^{-0.2}.
  Case c = TwoTokens({-1.0f, -1.2f}, {-2.0f, -1.0f}, {1.0f, 1.0f});
  LossConfig cfg;
  cfg.kind = LossKind::kImportanceSampling;
  cfg.tis_cap = 2.0;
  Metrics m;
  at::Tensor loss = ComputeLoss(cfg, c.in, c.den, &m);
  // ratio vs sampler: e^{1}, e^{-0.2}; loss = -(2 * e^{1} + e^{-0.2} * e^{-0.2}) / 2
  EXPECT_NEAR(loss.item<double>(), -(2 * std::exp(1.0) + std::exp(-0.4)) / 2, 1e-5);
  EXPECT_NEAR(m.Get("tis:mean"), (2.0 + std::exp(-0.2)) / 2, 1e-6);
  EXPECT_NEAR(m.Get("tis_clipfrac:mean"), 0.5, 1e-9);
  EXPECT_NEAR(m.Get("train_rollout_logprob_abs_diff:mean"), (1.0 + 0.2) / 2, 1e-6);
  // k3 with r = sampler - lp: (e^{-1} + 1 - 1) and (e^{0.2} - 0.2 - 1), averaged.
  EXPECT_NEAR(m.Get("train_rollout_kl:mean"),
              ((std::exp(-1.0) + 1 - 1) + (std::exp(0.2) - 0.2 - 1)) / 2, 1e-6);
}

TEST(LossesTest, KlEstimatorsAndEntropyBonus) {
  Case c = TwoTokens({-1.0f, -1.0f}, {-1.0f, -1.0f}, {0.0f, 0.0f});
  c.in.mask = T({1, 1});
  c.in.ref_logprobs = T({-1.5f, -0.5f});  // r = ref - lp = -0.5, +0.5
  LossConfig cfg;
  cfg.kind = LossKind::kImportanceSampling;
  cfg.kl_coef = 0.1;
  const double k1 = (0.5 + -0.5) / 2;
  const double k2 = (0.125 + 0.125) / 2;
  const double k3 = ((std::exp(-0.5) + 0.5 - 1) + (std::exp(0.5) - 0.5 - 1)) / 2;
  for (auto [est, expected] : {std::pair<KlEstimator, double>{KlEstimator::kK1, k1},
                               {KlEstimator::kK2, k2},
                               {KlEstimator::kK3, k3}}) {
    cfg.kl_estimator = est;
    Metrics m;
    at::Tensor loss = ComputeLoss(cfg, c.in, c.den, &m);
    EXPECT_NEAR(m.Get("kl_ref:mean"), expected, 1e-6);
    EXPECT_NEAR(loss.item<double>(), 0.1 * expected, 1e-6);  // A = 0: only the KL term
  }
  cfg.kl_coef = 0;
  cfg.entropy_coef = 0.01;
  Metrics m;
  // entropy 0.5, 1.5 -> loss = -0.01 * 1.0
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &m).item<double>(), -0.01, 1e-7);
  // k3 clamps: r = 20 -> clamp to 10 -> e^10 - 11, then result clamped to 10.
  c.in.ref_logprobs = T({19.0f, -1.0f});
  cfg.entropy_coef = 0;
  cfg.kl_coef = 1;
  cfg.kl_estimator = KlEstimator::kK3;
  Metrics mk;
  EXPECT_NEAR(ComputeLoss(cfg, c.in, c.den, &mk).item<double>(), (10.0 + 0.0) / 2, 1e-5);
}

TEST(LossesTest, SequenceNormalizationAveragesPerSample) {
  // Sample 0 has 1 loss-bearing token (lp -2), sample 1 has 3 (lp -1 each):
  // sequence mean = (2/1 + 3/3) / 2 = 1.5; token mean = 5/4 = 1.25.
  LossInputs in;
  in.logprobs = T({-2, -1, -1, -1, -7});
  in.entropy = T({0, 0, 0, 0, 0});
  in.mask = T({1, 1, 1, 1, 0});  // the last position is masked out
  in.sample_index = at::tensor(std::vector<int64_t>{0, 1, 1, 1, 1}, at::kLong);
  LossDenominators den;
  den.loss_tokens = 4;
  den.sample_tokens = T({1, 3});
  den.samples = 2;
  LossConfig cfg;
  Metrics m;
  EXPECT_NEAR(ComputeLoss(cfg, in, den, &m).item<double>(), 1.25, 1e-6);
  cfg.normalization = LossNormalization::kSequence;
  Metrics ms;
  EXPECT_NEAR(ComputeLoss(cfg, in, den, &ms).item<double>(), 1.5, 1e-6);
}

TEST(LossesTest, ConfigValidationNamesTheOption) {
  LossConfig c;
  c.clip_eps_low = 1.5;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "clip_eps_low"));
  c = LossConfig();
  c.dual_clip_c = 0.5;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "dual_clip_c"));
  c = LossConfig();
  c.tis_cap = -1;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "tis_cap"));
  c = LossConfig();
  c.kl_coef = NAN;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "kl_coef"));
  c = LossConfig();
  c.cispo_ratio_high = 0;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "cispo"));
  c = LossConfig();
  c.entropy_coef = INFINITY;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "entropy_coef"));
  c = LossConfig();
  c.clip_eps_high = -0.1;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "clip_eps_high"));
  // Values that would make the loss or the update non-finite (issue 26, defect 7).
  c = LossConfig();
  c.clip_eps_high = 1e300;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.clip_eps_high: must be in"));
  c = LossConfig();
  c.kl_coef = 1e300;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.kl_coef: must be in"));
  c = LossConfig();
  c.entropy_coef = -1e7;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.entropy_coef"));
  c = LossConfig();
  c.dual_clip_c = 1e30;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.dual_clip_c"));
  c = LossConfig();
  c.tis_cap = 1e30;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.tis_cap"));
  c = LossConfig();
  c.cispo_ratio_high = 1e30;
  EXPECT_THAT(ValidateLossConfig(c), StatusIs(absl::StatusCode::kInvalidArgument, "loss.cispo_ratio_high"));
  EXPECT_THAT(ParseLossKind("dpo"), StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn: unknown 'dpo'"));
  EXPECT_THAT(ParseKlEstimator("k4"), StatusIs(absl::StatusCode::kInvalidArgument, "kl_estimator"));
  EXPECT_THAT(ParseLossNormalization("mean"),
              StatusIs(absl::StatusCode::kInvalidArgument, "normalization"));
  EXPECT_EQ(ParseKlEstimator("low_var_kl").value(), KlEstimator::kK3);
}

TEST(BatchTest, ValidationNamesTheFieldAndIndex) {
  Datum d;
  d.tokens = {1, 2, 3};
  d.target_tokens = {2, 3, 4};
  d.logprobs = {-1, -1, -1};
  d.advantages = {0, 1, 1};
  LossConfig ppo;
  ppo.kind = LossKind::kPpo;
  EXPECT_TRUE(ValidateBatch({d}, ppo, 10).ok());
  {  // advantages of 3e38 froze a run (issue 26, defect 7); weights the same
    Datum huge = d;
    huge.advantages[2] = 3e38f;
    EXPECT_THAT(ValidateBatch({huge}, ppo, 10),
                StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].advantages[2]: 3e+38 has magnitude over"));
    huge.advantages[2] = -1e6f;
    EXPECT_TRUE(ValidateBatch({huge}, ppo, 10).ok());
    Datum heavy = d;
    heavy.weights = {1, 1, 2e6f};
    EXPECT_THAT(ValidateBatch({heavy}, LossConfig(), 10),
                StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].weights[2]: 2e+06 over 1e+06"));
  }
  EXPECT_THAT(ValidateBatch({}, ppo, 10), StatusIs(absl::StatusCode::kInvalidArgument, "datums: empty"));
  Datum bad = d;
  bad.advantages[2] = NAN;
  EXPECT_THAT(ValidateBatch({d, bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[1].advantages[2]: not finite"));
  bad = d;
  bad.tokens[1] = 10;
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[1]: id 10 outside"));
  bad = d;
  bad.target_tokens[0] = -1;
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].target_tokens[0]"));
  bad = d;
  bad.target_tokens.pop_back();
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].target_tokens: length"));
  bad = d;
  bad.logprobs.clear();
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].logprobs: required"));
  bad = d;
  bad.weights = {1, -1, 1};
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].weights[1]: negative"));
  bad = d;
  bad.tokens.clear();
  bad.target_tokens.clear();
  EXPECT_THAT(ValidateBatch({bad}, ppo, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens: empty"));
  LossConfig kl = ppo;
  kl.kl_coef = 0.1;
  EXPECT_THAT(ValidateBatch({d}, kl, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].ref_logprobs: required"));
  BatchLimits limits;
  limits.max_tokens_per_datum = 2;
  EXPECT_THAT(ValidateBatch({d}, ppo, 10, limits),
              StatusIs(absl::StatusCode::kInvalidArgument, "exceeds the limit"));
  EXPECT_FLOAT_EQ(LossMask(d, 0), 0.0f);  // advantage 0 -> not loss-bearing
  EXPECT_FLOAT_EQ(LossMask(d, 1), 1.0f);
}

TEST(BatchTest, MicroBatchesRespectThePaddedTokenBudget) {
  std::vector<Datum> ds(5);
  const int lens[5] = {4, 4, 8, 2, 9};
  for (int i = 0; i < 5; ++i) ds[i].tokens.assign(lens[i], 1);
  auto mbs = SplitIntoMicroBatches(ds, 8);
  // Longest first: [9] alone even though it exceeds the budget, [8], [4,4] (2x4=8), [2].
  ASSERT_EQ(mbs.size(), 4u);
  EXPECT_EQ(mbs[0], (std::vector<size_t>{4}));
  EXPECT_EQ(mbs[1], (std::vector<size_t>{2}));
  EXPECT_EQ(mbs[2], (std::vector<size_t>{0, 1}));
  EXPECT_EQ(mbs[3], (std::vector<size_t>{3}));
  // Length grouping pads less than arrival order: 1,8,1,8 in two pairs pads 32 tokens,
  // sorted it pads 18.
  std::vector<Datum> mixed(4);
  const int mixed_lens[4] = {1, 8, 1, 8};
  for (int i = 0; i < 4; ++i) mixed[i].tokens.assign(mixed_lens[i], 1);
  int64_t padded = 0;
  for (const auto& mb : SplitIntoMicroBatches(mixed, 16)) {
    int64_t longest = 0;
    for (size_t d : mb) longest = std::max<int64_t>(longest, mixed[d].tokens.size());
    padded += longest * static_cast<int64_t>(mb.size());
  }
  EXPECT_EQ(padded, 18);
}

TEST(BatchTest, PackedMicroBatchesFillTheRealTokenBudgetFirstFit) {
  std::vector<Datum> ds(6);
  const int lens[6] = {5, 3, 8, 2, 6, 10};
  for (int i = 0; i < 6; ++i) ds[i].tokens.assign(lens[i], 1);
  const auto mbs = PackIntoMicroBatches(ds, 8);
  // Longest first, each into the first micro-batch with room: [10] alone (over the budget),
  // [8], [6, 2], [5, 3].
  ASSERT_EQ(mbs.size(), 4u);
  EXPECT_EQ(mbs[0], (std::vector<size_t>{5}));
  EXPECT_EQ(mbs[1], (std::vector<size_t>{2}));
  EXPECT_EQ(mbs[2], (std::vector<size_t>{4, 3}));
  EXPECT_EQ(mbs[3], (std::vector<size_t>{0, 1}));
  // Every datum exactly once.
  std::vector<int> seen(ds.size(), 0);
  for (const auto& mb : mbs)
    for (size_t d : mb) ++seen[d];
  EXPECT_EQ(seen, std::vector<int>(ds.size(), 1));
}

// Co-scheduled runs under one loss compute it as one (ComputeJointLoss): each run's loss,
// gradient and metrics equal that run's ComputeLoss alone, for every normalization and for
// PPO with every term on (dual clip, TIS, KL to a reference, entropy bonus). The runs differ
// in length, masking, samples and denominators (as different batches do).
TEST(LossesTest, JointLossGivesEachRunItsOwnLossGradientAndMetrics) {
  at::manual_seed(3);
  const std::vector<int64_t> lengths = {5, 9, 3};
  for (LossNormalization norm : {LossNormalization::kToken, LossNormalization::kSequence, LossNormalization::kSum}) {
    LossConfig cfg;
    cfg.kind = LossKind::kPpo;
    cfg.dual_clip_c = 3.0;
    cfg.tis_cap = 2.0;
    cfg.kl_coef = 0.1;
    cfg.entropy_coef = 0.01;
    cfg.normalization = norm;
    std::vector<LossInputs> alone, together;
    std::vector<LossDenominators> dens;
    for (size_t j = 0; j < lengths.size(); ++j) {
      const int64_t n = lengths[j];
      LossInputs in;
      in.logprobs = (at::randn({n}) * 0.3 - 1.0).requires_grad_(true);
      in.entropy = at::rand({n});
      in.mask = (at::rand({n}) > 0.3).to(at::kFloat);
      in.mask[0] = 1.0;
      in.sample_index = at::arange(n, at::kLong).div(2, "floor");  // two positions a sample
      in.advantages = at::randn({n});
      in.sampler_logprobs = in.logprobs.detach() + at::randn({n}) * 0.2;
      in.old_logprobs = in.logprobs.detach() + at::randn({n}) * 0.1;
      in.ref_logprobs = in.logprobs.detach() + at::randn({n}) * 0.1;
      LossDenominators den;
      den.loss_tokens = in.mask.sum().item<double>() + static_cast<double>(j);  // other micro-batches too
      den.sample_tokens = at::zeros({(n + 1) / 2}).index_add_(0, in.sample_index, in.mask) + 1.0;
      den.samples = static_cast<double>((n + 1) / 2 + j);
      LossInputs copy = in;
      copy.logprobs = in.logprobs.detach().clone().requires_grad_(true);
      alone.push_back(in);
      together.push_back(copy);
      dens.push_back(den);
    }
    std::vector<PendingMetrics> pending(lengths.size());
    std::vector<const LossDenominators*> den_ptrs;
    std::vector<PendingMetrics*> pending_ptrs;
    for (size_t j = 0; j < lengths.size(); ++j) {
      den_ptrs.push_back(&dens[j]);
      pending_ptrs.push_back(&pending[j]);
    }
    const at::Tensor joint = ComputeJointLoss(cfg, together, den_ptrs, pending_ptrs);
    joint.backward();
    double sum = 0;
    for (size_t j = 0; j < lengths.size(); ++j) {
      Metrics solo_metrics, joint_metrics;
      const at::Tensor solo = ComputeLoss(cfg, alone[j], dens[j], &solo_metrics);
      solo.backward();
      sum += solo.item<double>();
      pending[j].Resolve(&joint_metrics);
      const std::string what = "run " + std::to_string(j) + " normalization " + std::to_string(static_cast<int>(norm));
      EXPECT_TRUE(at::allclose(together[j].logprobs.grad(), alone[j].logprobs.grad(), 1e-6, 1e-9)) << what;
      ASSERT_EQ(joint_metrics.Reduced().size(), solo_metrics.Reduced().size()) << what;
      for (const auto& [name, value] : solo_metrics.Reduced()) {
        ASSERT_TRUE(joint_metrics.Has(name)) << what << " " << name;
        EXPECT_NEAR(joint_metrics.Get(name), value, 1e-6 * std::max(1.0, std::abs(value))) << what << " " << name;
      }
    }
    EXPECT_NEAR(joint.item<double>(), sum, 1e-6 * std::max(1.0, std::abs(sum)));
  }
  // Runs whose inputs differ in kind are not one loss.
  LossInputs a = TwoTokens({-1.0f, -2.0f}, {0, 0}, {1, 1}).in, b = a;
  b.ref_logprobs = a.logprobs.detach();
  EXPECT_FALSE(SameLossInputsDefined(a, b));
  EXPECT_TRUE(SameLossInputsDefined(a, a));
}

}  // namespace
}  // namespace lorastep
