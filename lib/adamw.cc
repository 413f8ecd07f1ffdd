#include "lib/adamw.h"
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "absl/strings/str_cat.h"

namespace lorastep {

absl::StatusOr<LrScheduleKind> ParseLrSchedule(const std::string& name) {
  if (name.empty() || name == "constant") return LrScheduleKind::kConstant;
  if (name == "warmup") return LrScheduleKind::kWarmupConstant;
  if (name == "cosine") return LrScheduleKind::kCosine;
  return absl::InvalidArgumentError(
      absl::StrCat("adamw.schedule: unknown '", name, "' (constant, warmup, cosine)"));
}

absl::Status ValidateAdamWParams(const AdamWParams& p) {
  auto bad = [](const char* what) { return absl::InvalidArgumentError(what); };
  if (!std::isfinite(p.lr) || p.lr < 0) return bad("adamw.lr: must be finite and >= 0");
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("adamw.beta1: must be in [0, 1)");
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("adamw.beta2: must be in [0, 1)");
  if (!(p.eps > 0) || !std::isfinite(p.eps)) return bad("adamw.eps: must be > 0");
  if (!(p.weight_decay >= 0) || !std::isfinite(p.weight_decay)) {
    return bad("adamw.weight_decay: must be >= 0");
  }
  if (!(p.max_grad_norm >= 0) || !std::isfinite(p.max_grad_norm)) {
    return bad("adamw.max_grad_norm: must be >= 0 (0 = off)");
  }
  if (p.warmup_steps < 0) return bad("adamw.warmup_steps: must be >= 0");
  if (p.schedule == LrScheduleKind::kCosine && p.total_steps <= p.warmup_steps) {
    return bad("adamw.total_steps: cosine needs total_steps > warmup_steps");
  }
  if (!(p.min_lr_ratio >= 0 && p.min_lr_ratio <= 1)) {
    return bad("adamw.min_lr_ratio: must be in [0, 1]");
  }
  return absl::OkStatus();
}

double ScheduledLearningRate(const AdamWParams& p, int64_t steps_taken) {
  const double step = static_cast<double>(steps_taken + 1);
  if (p.schedule != LrScheduleKind::kConstant && p.warmup_steps > 0 &&
      steps_taken < p.warmup_steps) {
    return p.lr * step / static_cast<double>(p.warmup_steps);
  }
  if (p.schedule == LrScheduleKind::kCosine) {
    const double progress =
        std::min(1.0, static_cast<double>(steps_taken - p.warmup_steps) /
                          static_cast<double>(p.total_steps - p.warmup_steps));
    const double min_lr = p.lr * p.min_lr_ratio;
    return min_lr + (p.lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return p.lr;
}

AdamW::AdamW(Adapter* adapter) : adapter_(adapter) {
  for (const Parameter& p : adapter_->parameters()) {
    master_.push_back(p.value.detach().to(at::kFloat).clone());
    exp_avg_.push_back(at::zeros_like(master_.back()));
    exp_avg_sq_.push_back(at::zeros_like(master_.back()));
  }
}

void AdamW::PublishMasterToParameters() {
  at::NoGradGuard no_grad;
  auto& params = adapter_->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].value.copy_(master_[i]);
}

absl::StatusOr<OptimizerStepResult> AdamW::Step(const AdamWParams& p) {
  auto valid = ValidateAdamWParams(p);
  if (!valid.ok()) return valid;
  auto& params = adapter_->parameters();
  at::NoGradGuard no_grad;
  // Global L2 norm over every main_grad, in fp64 so the sum does not lose small terms.
  double sq = 0.0;
  for (const Parameter& prm : params) {
    sq += prm.main_grad.to(at::kDouble).pow(2).sum().item<double>();
  }
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) {
    return absl::FailedPreconditionError(
        "optimizer: non-finite gradient norm; step refused, parameters unchanged");
  }
  const double clip = (p.max_grad_norm > 0 && norm > p.max_grad_norm)
                          ? p.max_grad_norm / (norm + 1e-6)
                          : 1.0;
  const double lr = ScheduledLearningRate(p, steps_);
  const int64_t t = steps_ + 1;
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(t));
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = params[i].main_grad;
    if (clip != 1.0) g = g * clip;
    exp_avg_[i].mul_(p.beta1).add_(g, 1.0 - p.beta1);
    exp_avg_sq_[i].mul_(p.beta2).addcmul_(g, g, 1.0 - p.beta2);
    if (p.weight_decay > 0) master_[i].mul_(1.0 - lr * p.weight_decay);
    at::Tensor denom = (exp_avg_sq_[i] / bc2).sqrt_().add_(p.eps);
    master_[i].addcdiv_(exp_avg_[i], denom, -lr / bc1);
    params[i].value.copy_(master_[i]);
  }
  adapter_->ZeroMainGrads();
  steps_ = t;
  return OptimizerStepResult{norm, lr, t};
}

}  // namespace lorastep
