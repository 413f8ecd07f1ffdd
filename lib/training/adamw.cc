#include "lib/training/adamw.h"
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

AdamW::AdamW(Adapter* adapter) : adapter_(adapter) {
  for (const Parameter& p : adapter_->parameters()) {
    master_.push_back(p.value.detach().to(at::kFloat).clone());
    exp_avg_.push_back(at::zeros_like(master_.back()));
    exp_avg_sq_.push_back(at::zeros_like(master_.back()));
  }
}

absl::Status AdamW::CheckStep(const AdamWParams& p, double norm) const {
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(p));
  if (!std::isfinite(norm)) {
    return absl::FailedPreconditionError(
        "optimizer: non-finite gradient norm; step refused, parameters unchanged");
  }
  at::NoGradGuard no_grad;
  const auto& params = adapter_->parameters();
  const double clip = (p.max_grad_norm > 0 && norm > p.max_grad_norm) ? p.max_grad_norm / (norm + 1e-6) : 1.0;
  const double lr = ScheduledLearningRate(p, steps_);
  const int64_t t = steps_ + 1;
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(t));
  // The update computed aside: is every parameter, in its own dtype, still finite? One host
  // synchronization for all parameters.
  std::vector<at::Tensor> finite;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = params[i].main_grad;
    if (clip != 1.0) g = g * clip;
    at::Tensor m = exp_avg_[i] * p.beta1 + g * (1.0 - p.beta1);
    at::Tensor v = exp_avg_sq_[i] * p.beta2 + g * g * (1.0 - p.beta2);
    at::Tensor w = master_[i] * (1.0 - lr * p.weight_decay) - (m / ((v / bc2).sqrt() + p.eps)) * (lr / bc1);
    finite.push_back(at::isfinite(w.to(params[i].value.scalar_type())).all().reshape({1}));
  }
  if (!finite.empty()) {
    at::Tensor ok = at::cat(finite).to(at::kCPU);
    for (size_t i = 0; i < params.size(); ++i) {
      if (!ok[i].item<bool>()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "optimizer: the update would make ", params[i].name,
            " non-finite; step refused, parameters unchanged"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerStepResult> AdamW::Step(const AdamWParams& p,
                                                c10::optional<double> grad_norm) {
  auto valid = ValidateAdamWParams(p);
  if (!valid.ok()) return valid;
  auto& params = adapter_->parameters();
  at::NoGradGuard no_grad;
  // Global L2 norm over every main_grad, in fp64 so the sum does not lose small terms.
  double norm = 0.0;
  if (grad_norm.has_value()) {
    norm = *grad_norm;
  } else {
    double sq = 0.0;
    for (const Parameter& prm : params) {
      sq += prm.main_grad.to(at::kDouble).pow(2).sum().item<double>();
    }
    norm = std::sqrt(sq);
  }
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

void AdamW::ResyncFromParameters() {
  at::NoGradGuard no_grad;
  const auto& params = adapter_->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    master_[i].copy_(params[i].value);
    exp_avg_[i].zero_();
    exp_avg_sq_[i].zero_();
  }
}

}  // namespace lorastep
