#include "lib/training/adamw.h"
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

AdamW::AdamW(Adapter* adapter) : adapter_(adapter) {
  const auto& params = adapter_->parameters();
  int64_t total = 0;
  for (const Parameter& p : params) {
    offsets_.push_back(total);
    total += p.value.numel();
    same_dtype_ = same_dtype_ && p.value.scalar_type() == params.front().value.scalar_type();
  }
  if (params.empty()) return;
  // One flat fp32 buffer per state, in parameter order; the per-parameter tensors are views
  // of it, so a step is a dozen kernels over the flat buffers instead of a dozen per parameter.
  const auto f32 = params.front().value.options().dtype(at::kFloat).requires_grad(false);
  flat_master_ = at::empty({total}, f32);
  flat_avg_ = at::zeros({total}, f32);
  flat_avg_sq_ = at::zeros({total}, f32);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].value.numel();
    const auto shape = params[i].value.sizes();
    master_.push_back(flat_master_.narrow(0, offsets_[i], n).view(shape));
    exp_avg_.push_back(flat_avg_.narrow(0, offsets_[i], n).view(shape));
    exp_avg_sq_.push_back(flat_avg_sq_.narrow(0, offsets_[i], n).view(shape));
    master_.back().copy_(params[i].value);
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

AdamW::Update AdamW::CandidateUpdate(const AdamWParams& p, const Coefficients& k) const {
  // Every main_grad flattened in parameter order (one copy kernel).
  std::vector<at::Tensor> grads;
  for (const Parameter& prm : adapter_->parameters()) grads.push_back(prm.main_grad.reshape({-1}));
  at::Tensor g = at::cat(grads);
  if (k.clip != 1.0) g.mul_(k.clip);
  Update u;
  u.exp_avg = flat_avg_ * p.beta1 + g * (1.0 - p.beta1);
  u.exp_avg_sq = flat_avg_sq_ * p.beta2 + g.mul_(g) * (1.0 - p.beta2);
  u.master = flat_master_ * (1.0 - k.lr * p.weight_decay) -
             u.exp_avg / ((u.exp_avg_sq / k.bc2).sqrt_() + p.eps) * (k.lr / k.bc1);
  return u;
}

absl::Status AdamW::CheckStep(const AdamWParams& p, double norm) const { return Stage(p, norm).status(); }

absl::StatusOr<AdamW::StagedStep> AdamW::Stage(const AdamWParams& p, double norm) const {
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(p));
  if (!std::isfinite(norm)) {
    return absl::FailedPreconditionError(
        "optimizer: non-finite gradient norm; step refused, parameters unchanged");
  }
  StagedStep staged;
  staged.k = StepCoefficients(p, norm);
  staged.grad_norm = norm;
  const auto& params = adapter_->parameters();
  if (params.empty()) return staged;
  at::NoGradGuard no_grad;
  // The update computed aside: is every parameter, in its own dtype, still finite? One host
  // synchronization; the parameter is named from the first bad element's offset.
  staged.u = CandidateUpdate(p, staged.k);
  const at::Tensor& master = staged.u.master;
  at::Tensor bad;
  if (same_dtype_) {
    bad = at::isfinite(master.to(params.front().value.scalar_type())).logical_not_();
  } else {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < params.size(); ++i) {
      parts.push_back(at::isfinite(master.narrow(0, offsets_[i], params[i].value.numel())
                                       .to(params[i].value.scalar_type())).logical_not_());
    }
    bad = at::cat(parts);
  }
  const int64_t first = bad.any().item<bool>() ? bad.to(at::kByte).argmax().item<int64_t>() : -1;
  if (first < 0) return staged;
  const size_t i = std::upper_bound(offsets_.begin(), offsets_.end(), first) - offsets_.begin() - 1;
  return absl::FailedPreconditionError(absl::StrCat(
      "optimizer: the update would make ", params[i].name, " non-finite; step refused, parameters unchanged"));
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
    // Summed on the device: one host synchronization, not one per parameter.
    at::Tensor sq = at::zeros({}, params.empty() ? at::TensorOptions().dtype(at::kDouble)
                                                 : params.front().main_grad.options().dtype(at::kDouble));
    for (const Parameter& prm : params) sq = sq + prm.main_grad.to(at::kDouble).pow(2).sum();
    norm = std::sqrt(sq.item<double>());
  }
  LORASTEP_ASSIGN_OR_RETURN(StagedStep staged, Stage(p, norm));
  return Commit(std::move(staged));
}

OptimizerStepResult AdamW::Commit(StagedStep staged) {
  at::NoGradGuard no_grad;
  auto& params = adapter_->parameters();
  if (!params.empty()) {
    flat_avg_.copy_(staged.u.exp_avg);
    flat_avg_sq_.copy_(staged.u.exp_avg_sq);
    flat_master_.copy_(staged.u.master);
    for (size_t i = 0; i < params.size(); ++i) params[i].value.copy_(master_[i]);
  }
  adapter_->ZeroMainGrads();
  steps_ = staged.k.t;
  return OptimizerStepResult{staged.grad_norm, staged.k.lr, staged.k.t};
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
