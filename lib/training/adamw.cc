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

AdamW::Coefficients AdamW::StepCoefficients(const AdamWParams& p, double norm) const {
  Coefficients k;
  k.clip = (p.max_grad_norm > 0 && norm > p.max_grad_norm) ? p.max_grad_norm / (norm + 1e-6) : 1.0;
  k.lr = ScheduledLearningRate(p, steps_);
  k.t = steps_ + 1;
  k.bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(k.t));
  k.bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(k.t));
  return k;
}

AdamW::Update AdamW::CandidateUpdate(size_t i, const AdamWParams& p, const Coefficients& k) const {
  at::Tensor g = adapter_->parameters()[i].main_grad;
  if (k.clip != 1.0) g = g * k.clip;
  Update u;
  u.exp_avg = exp_avg_[i] * p.beta1 + g * (1.0 - p.beta1);
  u.exp_avg_sq = exp_avg_sq_[i] * p.beta2 + g * g * (1.0 - p.beta2);
  u.master = master_[i] * (1.0 - k.lr * p.weight_decay) -
             u.exp_avg / ((u.exp_avg_sq / k.bc2).sqrt() + p.eps) * (k.lr / k.bc1);
  return u;
}

absl::Status AdamW::CheckStep(const AdamWParams& p, double norm) const {
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(p));
  if (!std::isfinite(norm)) {
    return absl::FailedPreconditionError(
        "optimizer: non-finite gradient norm; step refused, parameters unchanged");
  }
  at::NoGradGuard no_grad;
  const auto& params = adapter_->parameters();
  const Coefficients k = StepCoefficients(p, norm);
  // The update computed aside: is every parameter, in its own dtype, still finite? One host
  // synchronization for all parameters.
  std::vector<at::Tensor> finite;
  for (size_t i = 0; i < params.size(); ++i) {
    const Update u = CandidateUpdate(i, p, k);
    finite.push_back(at::isfinite(u.master.to(params[i].value.scalar_type())).all().reshape({1}));
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
  const Coefficients k = StepCoefficients(p, norm);
  for (size_t i = 0; i < params.size(); ++i) {
    const Update u = CandidateUpdate(i, p, k);
    exp_avg_[i].copy_(u.exp_avg);
    exp_avg_sq_[i].copy_(u.exp_avg_sq);
    master_[i].copy_(u.master);
    params[i].value.copy_(master_[i]);
  }
  adapter_->ZeroMainGrads();
  steps_ = k.t;
  return OptimizerStepResult{norm, k.lr, k.t};
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
