// AdamW hyper-parameters and learning-rate schedules: torch-free, so the coordinator can
// validate an optimizer call before any work.
#ifndef LORASTEP_LIB_TRAINING_ADAMW_PARAMS_H_
#define LORASTEP_LIB_TRAINING_ADAMW_PARAMS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace lorastep {

enum class LrScheduleKind { kConstant, kWarmupConstant, kCosine };

struct AdamWParams {
  double lr = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 0.0;  // global-norm clip; 0 = off
  LrScheduleKind schedule = LrScheduleKind::kConstant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;     // cosine: steps until min_lr_ratio * lr
  double min_lr_ratio = 0.0;
};

absl::StatusOr<LrScheduleKind> ParseLrSchedule(const std::string& name);  // constant|warmup|cosine
// INVALID_ARGUMENT naming the field ("adamw.beta2: must be in [0, 1)").
// Bounds of ValidateAdamWParams: lr in [0, 1], max_grad_norm in [0, 1e6].
constexpr double kMaxLearningRate = 1.0;
constexpr double kMaxGradNormClip = 1e6;

absl::Status ValidateAdamWParams(const AdamWParams& params);
// The learning rate of the step that follows `steps_taken` earlier steps.
double ScheduledLearningRate(const AdamWParams& params, int64_t steps_taken);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_ADAMW_PARAMS_H_
