#include "lib/training/adamw_params.h"

#include <algorithm>
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
  // Upper bounds keep one step from wrecking a run: AdamW moves each element by about lr.
  if (!std::isfinite(p.lr) || p.lr < 0 || p.lr > kMaxLearningRate) {
    return bad("adamw.lr: must be in [0, 1]");
  }
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("adamw.beta1: must be in [0, 1)");
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("adamw.beta2: must be in [0, 1)");
  if (!(p.eps > 0 && p.eps <= 1)) return bad("adamw.eps: must be in (0, 1]");
  if (!(p.weight_decay >= 0) || !std::isfinite(p.weight_decay) || p.lr * p.weight_decay >= 1) {
    return bad("adamw.weight_decay: must be >= 0 with lr * weight_decay < 1");
  }
  if (!(p.max_grad_norm >= 0 && p.max_grad_norm <= kMaxGradNormClip)) {
    return bad("adamw.max_grad_norm: must be in [0, 1e6] (0 = off)");
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

}  // namespace lorastep
