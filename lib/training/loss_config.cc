#include "lib/training/loss_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace lorastep {

absl::StatusOr<LossKind> ParseLossKind(const std::string& name) {
  if (name == "cross_entropy") return LossKind::kCrossEntropy;
  if (name == "importance_sampling") return LossKind::kImportanceSampling;
  if (name == "ppo") return LossKind::kPpo;
  if (name == "cispo") return LossKind::kCispo;
  if (name == "dro") return LossKind::kDro;
  return absl::InvalidArgumentError(absl::StrCat(
      "loss.loss_fn: unknown '", name, "' (cross_entropy, importance_sampling, ppo, cispo, dro)"));
}

const char* LossKindName(LossKind kind) {
  switch (kind) {
    case LossKind::kCrossEntropy: return "cross_entropy";
    case LossKind::kImportanceSampling: return "importance_sampling";
    case LossKind::kPpo: return "ppo";
    case LossKind::kCispo: return "cispo";
    case LossKind::kDro: return "dro";
  }
  return "?";
}

absl::StatusOr<KlEstimator> ParseKlEstimator(const std::string& name) {
  if (name == "k1") return KlEstimator::kK1;
  if (name == "k2") return KlEstimator::kK2;
  if (name == "k3" || name == "low_var_kl") return KlEstimator::kK3;
  return absl::InvalidArgumentError(
      absl::StrCat("loss.kl_estimator: unknown '", name, "' (k1, k2, k3, low_var_kl)"));
}

absl::StatusOr<LossNormalization> ParseLossNormalization(const std::string& name) {
  if (name == "token") return LossNormalization::kToken;
  if (name == "sequence") return LossNormalization::kSequence;
  if (name == "sum") return LossNormalization::kSum;
  return absl::InvalidArgumentError(
      absl::StrCat("loss.normalization: unknown '", name, "' (token, sequence, sum)"));
}

absl::Status ValidateLossConfig(const LossConfig& c) {
  auto finite = [](double v) { return std::isfinite(v); };
  if (!finite(c.clip_eps_low) || c.clip_eps_low < 0 || c.clip_eps_low >= 1) {
    return absl::InvalidArgumentError("loss.clip_eps_low: must be in [0, 1)");
  }
  if (!finite(c.clip_eps_high) || c.clip_eps_high < 0 || c.clip_eps_high > kMaxClipBound) {
    return absl::InvalidArgumentError(absl::StrCat("loss.clip_eps_high: must be in [0, ", kMaxClipBound, "]"));
  }
  if (!finite(c.dual_clip_c) || (c.dual_clip_c != 0 && c.dual_clip_c <= 1) || c.dual_clip_c > kMaxLossCoefficient) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss.dual_clip_c: must be 0 (off) or in (1, ", kMaxLossCoefficient, "]"));
  }
  if (!finite(c.cispo_ratio_low) || !finite(c.cispo_ratio_high) || c.cispo_ratio_low < 0 ||
      c.cispo_ratio_high <= c.cispo_ratio_low || c.cispo_ratio_high > kMaxClipBound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss.cispo_ratio_high: need 0 <= cispo_ratio_low < cispo_ratio_high <= ", kMaxClipBound));
  }
  if (!finite(c.dro_beta) || c.dro_beta < 0 || c.dro_beta > kMaxLossCoefficient) {
    return absl::InvalidArgumentError(absl::StrCat("loss.dro_beta: must be in [0, ", kMaxLossCoefficient, "]"));
  }
  if (!finite(c.tis_cap) || c.tis_cap < 0 || c.tis_cap > kMaxLossCoefficient) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss.tis_cap: must be in [0, ", kMaxLossCoefficient, "] (0 = off)"));
  }
  if (!finite(c.kl_coef) || c.kl_coef < 0 || c.kl_coef > kMaxLossCoefficient) {
    return absl::InvalidArgumentError(absl::StrCat("loss.kl_coef: must be in [0, ", kMaxLossCoefficient, "]"));
  }
  if (!finite(c.entropy_coef) || std::abs(c.entropy_coef) > kMaxLossCoefficient) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss.entropy_coef: must be finite with magnitude <= ", kMaxLossCoefficient));
  }
  return absl::OkStatus();
}

}  // namespace lorastep
