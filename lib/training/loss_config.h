// The loss of a ForwardBackward call and its options, as RL trainers name them.
#ifndef LORASTEP_LIB_TRAINING_LOSS_CONFIG_H_
#define LORASTEP_LIB_TRAINING_LOSS_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"

namespace lorastep {

enum class LossKind { kCrossEntropy, kImportanceSampling, kPpo, kCispo, kDro };
enum class KlEstimator { kK1, kK2, kK3 };
// token: divide by the batch's loss-bearing token count; sequence: mean over samples of each
// sample's token mean; sum: no division (Tinker's cross_entropy).
enum class LossNormalization { kToken, kSequence, kSum };

struct LossConfig {
  LossKind kind = LossKind::kCrossEntropy;
  double clip_eps_low = 0.2;    // ppo: ratio clipped to [1 - low, 1 + high]
  double clip_eps_high = 0.28;
  double dual_clip_c = 0.0;     // ppo dual clip for A < 0; 0 = off, else > 1
  double cispo_ratio_low = 0.0;   // cispo: stop-gradient weight clamp(ratio, low, high)
  double cispo_ratio_high = 4.0;
  double dro_beta = 0.05;         // dro: weight of the quadratic penalty on lp - old
  double tis_cap = 0.0;         // truncated importance sampling cap C; 0 = off
  double kl_coef = 0.0;         // KL penalty to ref_logprobs; 0 = off
  KlEstimator kl_estimator = KlEstimator::kK3;
  double entropy_coef = 0.0;    // loss -= entropy_coef * entropy
  LossNormalization normalization = LossNormalization::kToken;

  bool is_rl() const { return kind != LossKind::kCrossEntropy; }
  bool operator==(const LossConfig& o) const {
    return kind == o.kind && clip_eps_low == o.clip_eps_low && clip_eps_high == o.clip_eps_high &&
           dual_clip_c == o.dual_clip_c && cispo_ratio_low == o.cispo_ratio_low &&
           cispo_ratio_high == o.cispo_ratio_high && dro_beta == o.dro_beta && tis_cap == o.tis_cap && kl_coef == o.kl_coef &&
           kl_estimator == o.kl_estimator && entropy_coef == o.entropy_coef && normalization == o.normalization;
  }
};

absl::StatusOr<LossKind> ParseLossKind(const std::string& name);  // "ppo", ...
absl::StatusOr<KlEstimator> ParseKlEstimator(const std::string& name);  // k1, k2, k3, low_var_kl
absl::StatusOr<LossNormalization> ParseLossNormalization(const std::string& name);
const char* LossKindName(LossKind kind);

// Range checks; INVALID_ARGUMENT naming the option ("loss.clip_eps_low: must be in [0, 1)").
// Bounds that keep the loss, its gradient and the optimizer state finite in fp32 for any
// accepted batch: a coefficient or clip bound larger than these (clip_eps_high 1e300, kl_coef
// 1e300) made the loss inf or the step fail with INTERNAL; an advantage or weight of 3e38
// gave a finite but huge update after which the run returned the same loss forever.
inline constexpr double kMaxLossCoefficient = 1e6;  // kl_coef, |entropy_coef|, tis_cap, dual_clip_c, dro_beta
inline constexpr double kMaxClipBound = 100;        // clip_eps_high, cispo_ratio_high
inline constexpr double kMaxTokenScale = 1e6;       // |advantages[i]|, weights[i]
absl::Status ValidateLossConfig(const LossConfig& config);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_LOSS_CONFIG_H_
