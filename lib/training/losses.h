// Token-level RL and supervised losses (formulas in docs/API.md, "Loss") with their metrics.
// Inputs are flat over the positions of one micro-batch; normalization uses batch-wide
// denominators so micro-batch losses (and their gradients) sum to the batch loss.
#ifndef LORASTEP_LIB_TRAINING_LOSSES_H_
#define LORASTEP_LIB_TRAINING_LOSSES_H_

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "lib/training/loss_config.h"
#include "lib/training/metrics.h"

namespace lorastep {

struct LossInputs {
  at::Tensor logprobs;          // fp32 [N], differentiable: the trainer's current log-probs
  at::Tensor entropy;           // fp32 [N], differentiable
  at::Tensor mask;              // fp32 [N]: LossMask per position (0 = not loss-bearing)
  at::Tensor sample_index;      // int64 [N]: which sample of the batch each position is in
  at::Tensor advantages;        // fp32 [N] or undefined
  at::Tensor sampler_logprobs;  // fp32 [N] or undefined: the rollout's log-probs
  at::Tensor old_logprobs;      // fp32 [N] or undefined: the trainer's old log-probs
  at::Tensor ref_logprobs;      // fp32 [N] or undefined
};

struct LossDenominators {
  double loss_tokens = 0;  // loss-bearing positions in the whole batch
  // per-sample loss-bearing counts, indexed like sample_index (sequence normalization)
  at::Tensor sample_tokens;
  double samples = 0;  // samples with at least one loss-bearing position, whole batch
};

// Metric partials kept on the device until Resolve, which reads all of them with one host
// synchronization (a step adds a dozen per micro-batch; one .item() each would stall the
// device stream a dozen times).
class PendingMetrics {
 public:
  void Add(const std::string& name, const at::Tensor& sum, const at::Tensor& count);
  void Add(const std::string& name, const at::Tensor& sum);  // count 1
  // `pair`: fp64 [2] (sum, count), kept as given (a row of several runs' partials: no kernel).
  void AddPair(const std::string& name, const at::Tensor& pair);
  void Resolve(Metrics* metrics);  // adds every partial to `metrics`, then empties

 private:
  std::vector<std::string> names_;
  std::vector<at::Tensor> values_;  // fp64 [2]: sum, count
};

// Returns the scalar loss of these positions (already normalized) and adds metrics:
// loss:sum, pg_loss:sum, entropy:mean, and as they apply pg_clipfrac:mean,
// pg_clipfrac_lower:mean (dual clip), ppo_kl:mean, kl_ref:mean, tis:mean, tis_clipfrac:mean,
// train_rollout_logprob_abs_diff:mean, train_rollout_kl:mean.
at::Tensor ComputeLoss(const LossConfig& config, const LossInputs& in,
                       const LossDenominators& denominators, PendingMetrics* metrics);
// The same, its metrics resolved at once.
at::Tensor ComputeLoss(const LossConfig& config, const LossInputs& in,
                       const LossDenominators& denominators, Metrics* metrics);

// Several runs' losses of one co-scheduled micro-batch under one LossConfig, computed as one:
// run j's inputs, denominators and metrics are ins[j], dens[j] and metrics[j] (the same
// inputs defined for every run). Each run's positions are normalized by its own denominators
// and its metrics are its own (reduced per run with one kernel each for all runs); returns the
// sum of the runs' losses, each equal to ComputeLoss of that run alone up to summation order.
at::Tensor ComputeJointLoss(const LossConfig& config, const std::vector<LossInputs>& ins,
                            const std::vector<const LossDenominators*>& dens,
                            const std::vector<PendingMetrics*>& metrics);
// Whether ComputeJointLoss takes these inputs: the same tensors defined in each.
bool SameLossInputsDefined(const LossInputs& a, const LossInputs& b);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_LOSSES_H_
