// AdamW over an adapter's parameters with fp32 master weights and fp32 moments, global
// gradient-norm clipping, and learning-rate schedules. Reads each Parameter's main_grad,
// writes the updated value back in the model dtype, and zeroes main_grad.
//
// Fails closed: a non-finite gradient norm is an error and nothing is updated.
#ifndef LORASTEP_LIB_TRAINING_ADAMW_H_
#define LORASTEP_LIB_TRAINING_ADAMW_H_

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/training/adamw_params.h"
#include "lib/model/adapter.h"

namespace lorastep {

struct OptimizerStepResult {
  double grad_norm = 0;  // before clipping
  double lr = 0;
  int64_t step = 0;      // steps taken, this one included
};

class AdamW {
 public:
  // Takes fp32 master copies of `adapter`'s current values; zero moments.
  explicit AdamW(Adapter* adapter);

  // `grad_norm`: the global norm of the main_grads when the caller computed it across ranks
  // (GradFinalizer); absent = computed here over this adapter's main_grads.
  absl::StatusOr<OptimizerStepResult> Step(const AdamWParams& params,
                                           c10::optional<double> grad_norm = c10::nullopt);

  // Whether Step(params, grad_norm) would succeed and leave every parameter finite in its
  // dtype (computed aside; changes nothing). FAILED_PRECONDITION naming the parameter.
  absl::Status CheckStep(const AdamWParams& params, double grad_norm) const;

  // A step in two halves, for a mesh's commit vote between them. Stage checks that every
  // parameter stays finite in its dtype (every allocation is made here) and changes nothing;
  // Commit writes the new moments, master copy and values and zeroes the gradients,
  // allocating nothing. The ATen path computes the new state aside in Stage and copies it in
  // Commit; the CUDA build's fused kernel computes it twice, the same bits both times, and
  // keeps no copy. Step is Stage then Commit.
  struct StagedStep;
  absl::StatusOr<StagedStep> Stage(const AdamWParams& params, double grad_norm) const;
  // Stage without the host wait: the finiteness check's figure stays on the device
  // (StagedStep::largest), so several runs' steps can be staged and checked with one wait.
  // CheckStaged refuses naming the first parameter the update would make non-finite;
  // `largest`: StagedStep::largest already on the host (else read here).
  absl::StatusOr<StagedStep> StageOnDevice(const AdamWParams& params, double grad_norm) const;
  absl::Status CheckStaged(const StagedStep& staged, std::optional<float> largest = std::nullopt) const;
  OptimizerStepResult Commit(StagedStep staged);
  // After parameters were replaced from outside (an imported adapter): the fp32 master copy
  // takes their values and the moments restart at zero, so the next step keeps them.
  void ResyncFromParameters();

  // Device bytes a StagedStep holds (the new moments and master copy, fp32; none where one
  // kernel checks the update and Commit recomputes it in place).
  int64_t StagedBytes() const { return flat_master_.defined() && !fused_ ? 3 * 4 * flat_master_.numel() : 0; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // Optimizer state in parameter order (for checkpoints): views of the flat fp32 buffers,
  // so copy_ into them writes through to the live state (never reassign them).
  std::vector<at::Tensor>& master() { return master_; }
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }

 private:
  // The step's scalars (clip factor, scheduled lr, step number, bias corrections), and the
  // new flat state computed aside: CheckStep and Step share the one formula.
  struct Coefficients {
    double clip = 1.0, lr = 0.0, bc1 = 1.0, bc2 = 1.0;
    int64_t t = 0;
  };
  struct Update {
    at::Tensor exp_avg, exp_avg_sq, master;
  };

 public:
  struct StagedStep {
    AdamWParams p;
    Coefficients k;
    Update u;  // undefined tensors when the adapter has no parameters, or on the fused path
    double grad_norm = 0;
    // fp32 scalar on the device: the new values' largest magnitude (NaN when one is NaN); with
    // mixed dtypes 0, or 1 when a value is non-finite in its own dtype. Undefined: no parameters.
    at::Tensor largest;
  };

 private:
  Coefficients StepCoefficients(const AdamWParams& p, double norm) const;
  Update CandidateUpdate(const AdamWParams& p, const Coefficients& k) const;
  at::Tensor FusedPass(const AdamWParams& p, const Coefficients& k, bool write) const;  // CUDA build only

  // Every main_grad flattened in the flat buffers' order (on packed buckets, the buckets
  // end to end: a few tensors, not one per parameter).
  at::Tensor FlatGradients() const;
  // The adapter's grad buckets that hold gradients, in bucket order.
  std::vector<at::Tensor> GradBuckets() const;

  Adapter* adapter_;
  // fp32, parameters in the adapter's BucketOrder: the grad buckets and the packed values
  // lie in that order, so gathering gradients and writing values are one kernel each.
  at::Tensor flat_master_, flat_avg_, flat_avg_sq_;
  std::vector<at::Tensor> master_, exp_avg_, exp_avg_sq_;  // views of the flat buffers, parameter order
  std::vector<int64_t> offsets_;  // parameter i's first element in the flat buffers
  std::vector<int> order_;        // parameter indices in flat order
  bool grads_packed_ = false;     // main_grads are the grad buckets end to end, in order_
  bool values_packed_ = false;    // the adapter's packed_values hold the values in order_
  bool same_dtype_ = true;
  // The CUDA build's one-pass kernel (lib/kernels/adamw_flat.h) for state on the GPU with one
  // value dtype and the gradients in the buckets: Stage checks without writing, Commit
  // recomputes the same bits in place.
  bool fused_ = false;
  int64_t steps_ = 0;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_ADAMW_H_
