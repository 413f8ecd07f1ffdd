// AdamW against a scalar reference written from the algorithm (PyTorch's AdamW: decoupled
// decay, bias correction), clipping, schedules, and fail-closed behaviour.
#include "lib/training/adamw.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/training/sums_of_squares.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;

Adapter OneParameterAdapter(float value, at::ScalarType dtype = at::kFloat) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.num_hidden_layers = 1;
  LoraConfig lora;
  lora.rank = 1;
  lora.target_modules = {"q_proj"};
  Adapter a = Adapter::CreateLora(c, lora, at::kCPU, dtype, 1).value();
  for (auto& p : a.parameters()) {
    at::NoGradGuard g;
    p.value.fill_(value);
  }
  return a;
}

TEST(AdamWTest, MatchesScalarReferenceWithDecayAndBiasCorrection) {
  Adapter adapter = OneParameterAdapter(0.5f);
  AdamW opt(&adapter);
  AdamWParams p;
  p.lr = 0.1;
  p.beta1 = 0.9;
  p.beta2 = 0.99;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  double w = 0.5, m = 0, v = 0;
  const double grads[3] = {0.3, -0.2, 0.05};
  for (int t = 1; t <= 3; ++t) {
    for (auto& prm : adapter.parameters()) prm.main_grad.fill_(grads[t - 1]);
    ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, opt.Step(p));
    const double g = grads[t - 1];
    w *= 1 - p.lr * p.weight_decay;
    m = p.beta1 * m + (1 - p.beta1) * g;
    v = p.beta2 * v + (1 - p.beta2) * g * g;
    const double mhat = m / (1 - std::pow(p.beta1, t)), vhat = v / (1 - std::pow(p.beta2, t));
    w -= p.lr * mhat / (std::sqrt(vhat) + p.eps);
    EXPECT_EQ(r.step, t);
    EXPECT_NEAR(adapter.parameters()[0].value[0][0].item<double>(), w, 1e-6) << t;
    EXPECT_EQ(adapter.parameters()[0].main_grad.abs().sum().item<double>(), 0.0);  // zeroed
  }
}

TEST(AdamWTest, ClipsByTheGlobalNormAndReportsItBeforeClipping) {
  Adapter adapter = OneParameterAdapter(0.0f);
  AdamW opt(&adapter);
  int64_t n = 0;
  for (auto& prm : adapter.parameters()) {
    prm.main_grad.fill_(2.0);
    n += prm.main_grad.numel();
  }
  AdamWParams p;
  p.max_grad_norm = 1.0;
  p.lr = 1e-3;
  ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, opt.Step(p));
  EXPECT_NEAR(r.grad_norm, 2.0 * std::sqrt(static_cast<double>(n)), 1e-4);
  // After clipping, Adam's first step still moves each weight by ~lr (sign of the gradient).
  EXPECT_NEAR(adapter.parameters()[0].value[0][0].item<double>(), -1e-3, 1e-6);
  EXPECT_NEAR(opt.exp_avg()[0][0][0].item<double>(), 0.1 * 2.0 / (2.0 * std::sqrt(double(n))), 1e-6);
}

TEST(AdamWTest, NonFiniteGradientFailsClosed) {
  Adapter adapter = OneParameterAdapter(0.25f);
  AdamW opt(&adapter);
  adapter.parameters()[1].main_grad[0][0] = NAN;
  EXPECT_THAT(opt.Step(AdamWParams()), StatusIs(absl::StatusCode::kFailedPrecondition, "non-finite"));
  EXPECT_EQ(opt.steps_taken(), 0);
  EXPECT_FLOAT_EQ(adapter.parameters()[0].value[0][0].item<float>(), 0.25f);
  EXPECT_EQ(opt.exp_avg()[0].abs().sum().item<double>(), 0.0);
}

TEST(AdamWTest, Schedules) {
  AdamWParams p;
  p.lr = 1.0;
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(p, 5), 1.0);
  p.schedule = LrScheduleKind::kWarmupConstant;
  p.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(p, 0), 0.25);
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(p, 3), 1.0);
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(p, 9), 1.0);
  p.schedule = LrScheduleKind::kCosine;
  p.total_steps = 14;
  p.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(ScheduledLearningRate(p, 1), 0.5);                     // warming up
  EXPECT_NEAR(ScheduledLearningRate(p, 4), 1.0, 1e-12);                   // peak
  EXPECT_NEAR(ScheduledLearningRate(p, 9), 0.1 + 0.9 * 0.5, 1e-12);       // halfway
  EXPECT_NEAR(ScheduledLearningRate(p, 14), 0.1, 1e-12);                  // floor
  EXPECT_NEAR(ScheduledLearningRate(p, 40), 0.1, 1e-12);                  // stays there
}

TEST(AdamWTest, ValidationNamesTheField) {
  AdamWParams p;
  p.lr = -1;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.lr"));
  p = AdamWParams();
  p.beta1 = 1;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.beta1"));
  p = AdamWParams();
  p.eps = 0;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.eps"));
  p = AdamWParams();
  p.weight_decay = -0.1;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "weight_decay"));
  p = AdamWParams();
  p.max_grad_norm = NAN;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "max_grad_norm"));
  p = AdamWParams();
  p.schedule = LrScheduleKind::kCosine;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "total_steps"));
  p = AdamWParams();
  p.warmup_steps = -1;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "warmup_steps"));
  p = AdamWParams();
  p.min_lr_ratio = 2;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "min_lr_ratio"));
  EXPECT_THAT(ParseLrSchedule("linear"), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.schedule"));
  Adapter adapter = OneParameterAdapter(0.f);
  AdamW opt(&adapter);
  p = AdamWParams();
  p.beta2 = 2;
  EXPECT_THAT(opt.Step(p), StatusIs(absl::StatusCode::kInvalidArgument, "beta2"));
}

// A step that would overflow a parameter in its own dtype is refused by CheckStep, and
// nothing changes: here an fp32 master value that rounds to inf in bf16.
TEST(AdamWTest, CheckStepRefusesAnUpdateThatLeavesANonFiniteParameter) {
  Adapter adapter = OneParameterAdapter(0.5f, at::kBFloat16);
  AdamW opt(&adapter);
  AdamWParams p;
  p.lr = 1e-3;
  for (auto& prm : adapter.parameters()) prm.main_grad.fill_(0.1);
  EXPECT_TRUE(opt.CheckStep(p, 1.0).ok());
  opt.master()[1].fill_(3.4e38f);  // finite in fp32, past bf16's largest (3.39e38)
  const at::Tensor before = adapter.parameters()[1].value.clone();
  EXPECT_THAT(opt.CheckStep(p, 1.0),
              StatusIs(absl::StatusCode::kFailedPrecondition, "would make " + adapter.parameters()[1].name + " non-finite"));
  EXPECT_TRUE(at::equal(adapter.parameters()[1].value, before));
  EXPECT_EQ(opt.master()[1][0][0].item<float>(), 3.4e38f);
  EXPECT_THAT(opt.CheckStep(p, NAN), StatusIs(absl::StatusCode::kFailedPrecondition, "non-finite gradient norm"));
  p.lr = 1e30;
  EXPECT_THAT(opt.CheckStep(p, 1.0), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.lr: must be in [0, 1]"));
}

// The optimizer's flat state follows the grad buckets (not parameter order) and writes the
// packed values in one copy: with q/o/down factors on two layers the buckets interleave the
// parameters, and each parameter must still get exactly its own update, its own name.
TEST(AdamWTest, BucketOrderedStateGivesEachParameterItsOwnUpdate) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.num_hidden_layers = 2;
  LoraConfig lora;
  lora.rank = 2;
  lora.target_modules = {"q_proj", "o_proj", "down_proj"};
  Adapter adapter = Adapter::CreateLora(c, lora, at::kCPU, at::kBFloat16, 3).value();
  const std::vector<int> order = adapter.BucketOrder();
  ASSERT_EQ(order.size(), adapter.parameters().size());
  ASSERT_FALSE(std::is_sorted(order.begin(), order.end()));  // the buckets do interleave
  for (const Parameter& prm : adapter.parameters()) {
    EXPECT_TRUE(prm.value.is_alias_of(adapter.packed_values())) << prm.name;
    EXPECT_TRUE(prm.value.requires_grad() && prm.value.is_leaf()) << prm.name;
  }
  AdamW opt(&adapter);
  AdamWParams p;
  p.lr = 0.01;
  p.eps = 1e-3;
  p.weight_decay = 0;
  std::vector<at::Tensor> before;
  for (size_t i = 0; i < adapter.parameters().size(); ++i) {
    Parameter& prm = adapter.parameters()[i];
    before.push_back(opt.master()[i].clone());
    prm.main_grad.fill_(1e-3 * static_cast<double>(i + 1));
  }
  ASSERT_TRUE(opt.Step(p, 1.0).ok());
  for (size_t i = 0; i < adapter.parameters().size(); ++i) {
    const double g = 1e-3 * static_cast<double>(i + 1);  // first step: m/sqrt(v) = g/|g|, eps added to |g|
    const at::Tensor want = before[i] - p.lr * g / (g + p.eps);
    EXPECT_TRUE(at::allclose(opt.master()[i], want, 1e-6, 1e-7)) << adapter.parameters()[i].name;
    EXPECT_TRUE(at::equal(adapter.parameters()[i].value, opt.master()[i].to(at::kBFloat16)))
        << adapter.parameters()[i].name;
    EXPECT_EQ(adapter.parameters()[i].main_grad.abs().max().item<float>(), 0.0f);
  }
  // A parameter late in parameter order but early in the buckets is named by its own name.
  const int bad = order[1];
  for (auto& prm : adapter.parameters()) prm.main_grad.fill_(0.1);
  opt.master()[bad].fill_(3.4e38f);
  EXPECT_THAT(opt.CheckStep(p, 1.0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              "would make " + adapter.parameters()[bad].name + " non-finite"));
  // A NaN is caught too (the check reads the largest magnitude, which a NaN turns into NaN).
  opt.master()[bad].fill_(0.5f);
  const int nan_at = order[2];
  opt.master()[nan_at].view({-1})[3] = NAN;
  EXPECT_THAT(opt.CheckStep(p, 1.0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              "would make " + adapter.parameters()[nan_at].name + " non-finite"));
  opt.master()[nan_at].fill_(0.5f);
  EXPECT_TRUE(opt.CheckStep(p, 1.0).ok());
}

// The optimizer on the device under test (on CUDA, one fused kernel that checks the update
// without writing and then recomputes it in place) against the same steps on the host (the
// ATen composition): three steps with clipping, decay and bias correction agree within fp32
// rounding; a refused update (an overflow in bf16, a NaN) names its parameter and changes
// nothing, and a step after it goes through.
TEST(AdamWTest, OnTheTestDeviceAsOnTheHost) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.num_hidden_layers = 2;
  LoraConfig lora;
  lora.rank = 4;
  lora.target_modules = {"q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"};
  const at::Device dev = ::lorastep::testing::TestDevice();
  Adapter host = Adapter::CreateLora(c, lora, at::kCPU, at::kBFloat16, 5).value();
  Adapter device = Adapter::CreateLora(c, lora, dev, at::kBFloat16, 5).value();
  AdamW host_opt(&host), device_opt(&device);
  AdamWParams p;
  p.lr = 0.01;
  p.weight_decay = 0.1;
  p.max_grad_norm = 0.5;
  auto fill_grads = [&](int step) {
    for (size_t i = 0; i < host.parameters().size(); ++i) {
      const at::Tensor g = at::randn(host.parameters()[i].main_grad.sizes(),
                                     at::TensorOptions().dtype(at::kFloat)) * (0.1 * (step + 1));
      host.parameters()[i].main_grad.copy_(g);
      device.parameters()[i].main_grad.copy_(g);
    }
  };
  at::manual_seed(11);
  for (int step = 0; step < 3; ++step) {
    fill_grads(step);
    ASSERT_OK_AND_ASSIGN(OptimizerStepResult h, host_opt.Step(p));
    ASSERT_OK_AND_ASSIGN(OptimizerStepResult d, device_opt.Step(p));
    EXPECT_NEAR(d.grad_norm, h.grad_norm, 1e-6 * h.grad_norm) << step;
    for (size_t i = 0; i < host.parameters().size(); ++i) {
      const std::string& name = host.parameters()[i].name;
      EXPECT_LT(::lorastep::testing::RelErr(device_opt.master()[i], host_opt.master()[i]), 1e-6) << name << " " << step;
      EXPECT_LT(::lorastep::testing::RelErr(device_opt.exp_avg_sq()[i], host_opt.exp_avg_sq()[i]), 1e-6) << name;
      EXPECT_TRUE(at::equal(device.parameters()[i].value.cpu(), device_opt.master()[i].cpu().to(at::kBFloat16))) << name;
      EXPECT_EQ(device.parameters()[i].main_grad.abs().max().item<float>(), 0.0f) << name;
    }
  }
  const std::vector<int> order = device.BucketOrder();
  const int bad = order[1], nan_at = order[2];
  auto expect_refused_unchanged = [&](int named) {
    const at::Tensor master = device_opt.master()[named].clone(), avg = device_opt.exp_avg()[named].clone();
    EXPECT_THAT(device_opt.Step(p, 1.0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                  "would make " + device.parameters()[named].name + " non-finite"));
    // Bit for bit (a NaN the test planted compares unequal to itself as a float).
    EXPECT_TRUE(at::equal(device_opt.master()[named].view(at::kInt), master.view(at::kInt)));
    EXPECT_TRUE(at::equal(device_opt.exp_avg()[named].view(at::kInt), avg.view(at::kInt)));
    EXPECT_EQ(device_opt.steps_taken(), 3);
  };
  fill_grads(3);
  device_opt.master()[bad].fill_(3.4e38f);  // finite in fp32, past bf16's largest
  expect_refused_unchanged(bad);
  device_opt.master()[bad].fill_(0.5f);
  device_opt.master()[nan_at].view({-1})[1] = NAN;
  expect_refused_unchanged(nan_at);
  device_opt.master()[nan_at].fill_(0.5f);
  ASSERT_OK_AND_ASSIGN(OptimizerStepResult after, device_opt.Step(p, 1.0));
  EXPECT_EQ(after.step, 4);
  EXPECT_TRUE(at::isfinite(device_opt.master()[nan_at]).all().item<bool>());
}

// Parameters of different dtypes (each checked in its own): a step goes through, and an
// update that overflows one of them in its dtype is refused naming it.
TEST(AdamWTest, MixedDtypesAreCheckedEachInItsOwn) {
  Adapter adapter = OneParameterAdapter(0.5f, at::kBFloat16);
  adapter.parameters()[0].value = adapter.parameters()[0].value.detach().to(at::kFloat).requires_grad_(true);
  AdamW opt(&adapter);
  AdamWParams p;
  p.lr = 1e-3;
  for (auto& prm : adapter.parameters()) prm.main_grad.fill_(0.1);
  ASSERT_TRUE(opt.Step(p, 1.0).ok());
  EXPECT_EQ(adapter.parameters()[0].value.scalar_type(), at::kFloat);
  EXPECT_NEAR(adapter.parameters()[1].value.to(at::kFloat).max().item<float>(), 0.499f, 1e-2);
  for (auto& prm : adapter.parameters()) prm.main_grad.fill_(0.1);
  opt.master()[1].fill_(3.4e38f);  // finite in fp32, past bf16's largest
  EXPECT_THAT(opt.CheckStep(p, 1.0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              "would make " + adapter.parameters()[1].name + " non-finite"));
}

TEST(AdamWTest, HyperParametersAreBounded) {
  AdamWParams p;
  p.max_grad_norm = 1e300;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.max_grad_norm"));
  p = AdamWParams();
  p.lr = 0.5;
  p.weight_decay = 2;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "lr * weight_decay < 1"));
  p = AdamWParams();
  p.eps = 2;
  EXPECT_THAT(ValidateAdamWParams(p), StatusIs(absl::StatusCode::kInvalidArgument, "adamw.eps"));
  LoraConfig lora;
  lora.alpha = INFINITY;
  EXPECT_THAT(ValidateLoraConfig(lora), StatusIs(absl::StatusCode::kInvalidArgument, "lora.alpha"));
  lora.alpha = 32;
  lora.rank = 20000;
  EXPECT_THAT(ValidateLoraConfig(lora), StatusIs(absl::StatusCode::kInvalidArgument, "lora.rank: 20000 exceeds the limit of 1024"));
}

// The squared norms of several groups in one pass (on CUDA one launch for every run's grad
// buckets) against a dense fp64 sum per group; each group's value is the same bits whether it
// is summed alone or with others, and undefined, negative and strided terms count as stated.
TEST(GroupSumsOfSquaresTest, EachGroupAsADenseSumAloneOrTogether) {
  const at::Device dev = ::lorastep::testing::TestDevice();
  at::manual_seed(3);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor big = at::randn({200003}, f32), small = at::randn({7, 5}, f32), other = at::randn({65536}, f32);
  auto on = [&](const at::Tensor& t) { return t.to(dev); };
  const std::vector<std::vector<SquareTerm>> groups{
      {{on(big)}, {on(small), /*negative=*/true}},
      {},
      {{at::Tensor()}, {on(other)}},
  };
  auto dense = [](const at::Tensor& t) { return t.to(at::kDouble).pow(2).sum().item<double>(); };
  const std::vector<double> expected{dense(big) - dense(small), 0.0, dense(other)};
  const at::Tensor together = GroupSumsOfSquares(groups, dev);
  ASSERT_EQ(together.numel(), 3);
  EXPECT_EQ(together.scalar_type(), at::kDouble);
  EXPECT_EQ(together.device().type(), dev.type());
  const at::Tensor host = together.cpu();
  for (int g = 0; g < 3; ++g) {
    EXPECT_NEAR(host[g].item<double>(), expected[g], 1e-12 * std::abs(expected[g])) << g;
    const at::Tensor alone = GroupSumsOfSquares({groups[g]}, dev).cpu();
    EXPECT_TRUE(at::equal(alone[0], host[g])) << g;
  }
  // A strided term is summed as its elements are.
  const at::Tensor wide = on(at::randn({64, 48}, f32));
  const at::Tensor strided = GroupSumsOfSquares({{{wide.t()}}}, dev).cpu();
  EXPECT_NEAR(strided[0].item<double>(), dense(wide.cpu()), 1e-12 * dense(wide.cpu()));
  EXPECT_EQ(GroupSumsOfSquares({}, dev).numel(), 0);
}

}  // namespace
}  // namespace lorastep
