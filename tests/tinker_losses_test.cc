// The Tinker SDK's losses through lorastep's: LossConfigFromTinker's config, read as the
// coordinator reads it (LossConfigFromProto), gives the loss and gradient of Tinker's formula
// written out here in fp64 (a sum over tokens); defaults as the SDK's docs give them; every
// refusal names the key.
#include "server/tinker_losses.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lib/training/losses.h"
#include "rpc/proto_convert.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;

// Tinker's per-token loss of (lp, q, A, w), as its docs write it.
using TinkerFormula = std::function<double(double lp, double q, double a, double w)>;

void ExpectTinkerLoss(const std::string& loss_fn, const std::map<std::string, double>& config,
                      const TinkerFormula& formula) {
  SCOPED_TRACE(loss_fn);
  ASSERT_OK_AND_ASSIGN(v1::LossConfig proto, LossConfigFromTinker(loss_fn, config));
  ASSERT_OK_AND_ASSIGN(LossConfig cfg, LossConfigFromProto(proto));
  at::manual_seed(3);
  const int64_t n = 48;
  LossInputs in;
  in.logprobs = (-at::rand({n}, at::kDouble) * 2).to(at::kFloat).requires_grad_(true);
  in.sampler_logprobs = (in.logprobs.detach() + at::randn({n}) * 0.3).to(at::kFloat);  // ratios around 1, some clipped
  in.advantages = at::randn({n}, at::kFloat);
  in.entropy = at::zeros({n}, at::kFloat);
  // cross_entropy's weights ride in the mask (the datum's weights); the RL losses take 0/1.
  in.mask = loss_fn == "cross_entropy" ? at::rand({n}, at::kFloat) * (at::rand({n}) > 0.2).to(at::kFloat)
                                       : (at::rand({n}) > 0.2).to(at::kFloat);
  in.sample_index = at::zeros({n}, at::kLong);
  LossDenominators den;
  den.loss_tokens = (in.mask != 0).sum().item<double>();
  den.sample_tokens = at::full({1}, den.loss_tokens, at::kDouble);
  den.samples = 1;
  Metrics m;
  at::Tensor loss = ComputeLoss(cfg, in, den, &m);
  loss.backward();
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double w = in.mask[i].item<double>();
    if (w == 0) continue;
    const double lp = in.logprobs[i].item<double>(), q = in.sampler_logprobs[i].item<double>();
    const double a = in.advantages[i].item<double>();
    want += (loss_fn == "cross_entropy" ? 1.0 : w) * formula(lp, q, a, w);
    // The gradient by central differences of the formula (stop-gradient terms held: cispo's
    // clipped ratio is computed at the unperturbed lp).
    const double h = 1e-6;
    const double grad = (formula(lp + h, q, a, w) - formula(lp - h, q, a, w)) / (2 * h);
    const double cispo_grad = loss_fn == "cispo" ? -std::clamp(std::exp(lp - q), config.count("clip_low_threshold") ? config.at("clip_low_threshold") : 0.8,
                                                               config.count("clip_high_threshold") ? config.at("clip_high_threshold") : 1.2) * a
                                                 : grad;
    EXPECT_NEAR(in.logprobs.grad()[i].item<double>(), loss_fn == "cispo" ? cispo_grad : grad, 1e-3) << i;
  }
  EXPECT_NEAR(loss.item<double>(), want, 1e-4 * std::max(1.0, std::abs(want)));
  EXPECT_NEAR(m.Get("loss:sum"), want, 1e-4 * std::max(1.0, std::abs(want)));
}

TEST(TinkerLossesTest, EveryLossIsTinkersFormulaSummedOverTokens) {
  ExpectTinkerLoss("cross_entropy", {}, [](double lp, double, double, double w) { return -lp * w; });
  ExpectTinkerLoss("importance_sampling", {}, [](double lp, double q, double a, double) { return -std::exp(lp - q) * a; });
  for (const auto& [lo, hi] : std::vector<std::pair<double, double>>{{0.8, 1.2}, {0.9, 1.3}}) {
    std::map<std::string, double> config = {{"clip_low_threshold", lo}, {"clip_high_threshold", hi}};
    ExpectTinkerLoss("ppo", config, [lo = lo, hi = hi](double lp, double q, double a, double) {
      const double r = std::exp(lp - q);
      return -std::min(r * a, std::clamp(r, lo, hi) * a);
    });
    ExpectTinkerLoss("cispo", config, [lo = lo, hi = hi](double lp, double q, double a, double) {
      return -std::clamp(std::exp(lp - q), lo, hi) * lp * a;
    });
  }
  ExpectTinkerLoss("ppo", {}, [](double lp, double q, double a, double) {  // the SDK's defaults: 0.8, 1.2
    const double r = std::exp(lp - q);
    return -std::min(r * a, std::clamp(r, 0.8, 1.2) * a);
  });
  for (double beta : {0.05, 0.5}) {
    ExpectTinkerLoss("dro", {{"beta", beta}}, [beta](double lp, double q, double a, double) {
      return -(lp * a - beta / 2 * (lp - q) * (lp - q));
    });
  }
  ASSERT_OK_AND_ASSIGN(v1::LossConfig dro, LossConfigFromTinker("dro", {}));
  EXPECT_DOUBLE_EQ(dro.dro_beta(), 0.05);
  EXPECT_EQ(dro.normalization(), "sum");
}

TEST(TinkerLossesTest, RefusalsNameTheKey) {
  EXPECT_THAT(LossConfigFromTinker("dpo", {}), StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn: unknown 'dpo'"));
  EXPECT_THAT(LossConfigFromTinker("ppo", {{"beta", 0.1}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "loss_fn_config.beta: not a key of ppo (clip_low_threshold, clip_high_threshold)"));
  EXPECT_THAT(LossConfigFromTinker("cross_entropy", {{"clip_low_threshold", 0.8}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "not a key of cross_entropy (it takes none)"));
  EXPECT_THAT(LossConfigFromTinker("ppo", {{"clip_low_threshold", NAN}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn_config.clip_low_threshold: not finite"));
  EXPECT_THAT(LossConfigFromTinker("ppo", {{"clip_low_threshold", 1.5}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn_config.clip_low_threshold: 1.5 is not in (0, 1]"));
  EXPECT_THAT(LossConfigFromTinker("ppo", {{"clip_high_threshold", 0.9}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn_config.clip_high_threshold"));
  EXPECT_THAT(LossConfigFromTinker("cispo", {{"clip_low_threshold", 2}, {"clip_high_threshold", 1.5}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn_config.clip_high_threshold"));
  EXPECT_THAT(LossConfigFromTinker("dro", {{"beta", -1}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn_config.beta: -1 is not in [0, "));
}

}  // namespace
}  // namespace lorastep
