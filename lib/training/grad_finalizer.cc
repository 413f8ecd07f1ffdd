#include "lib/training/grad_finalizer.h"
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "lib/status_macros.h"
#include "lib/torch_status.h"

namespace lorastep {

absl::Status FoldLocalGradients(Adapter* adapter) {
  return GuardTorch([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    for (Parameter& p : adapter->parameters()) {
      at::Tensor& grad = p.value.mutable_grad();
      if (!grad.defined()) continue;
      p.main_grad.add_(grad.to(at::kFloat));
      grad = at::Tensor();  // moved into main_grad: never added twice
    }
    return absl::OkStatus();
  });
}

namespace {

at::Tensor SumOfSquares(const at::Tensor& bucket, const at::Device& device) {
  if (!bucket.defined()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  return bucket.to(at::kDouble).pow(2).sum();  // fp64: small terms are not lost
}

}  // namespace

absl::StatusOr<double> FinalizeStepGradients(Adapter* adapter, ProcessGroups* groups,
                                             const GradFinalizeOptions& options) {
  return GuardTorch([&]() -> absl::StatusOr<double> {
    at::NoGradGuard no_grad;
    at::Tensor split = adapter->grad_bucket(GradBucket::kSplit);
    at::Tensor partial = adapter->grad_bucket(GradBucket::kReplicatedPartial);
    at::Tensor full = adapter->grad_bucket(GradBucket::kReplicatedFull);
    if (groups != nullptr) {
      // The tied embedding's two copies (first and last stage) each hold part of its
      // gradient (lookup, LM head): Megatron's embedding-group all-reduce.
      for (Parameter& p : adapter->parameters()) {
        if (p.tied_across_stages) {
          LORASTEP_RETURN_IF_ERROR(groups->group(GroupKind::kEmbedding).AllReduce(p.main_grad));
        }
      }
      if (partial.defined()) {
        for (int i = 0; i < options.replicated_reductions; ++i) {
          LORASTEP_RETURN_IF_ERROR(groups->group(GroupKind::kStage).AllReduce(partial));
        }
      }
      for (at::Tensor* bucket : {&split, &full}) {
        if (bucket->defined()) LORASTEP_RETURN_IF_ERROR(groups->group(GroupKind::kData).AllReduce(*bucket));
      }
    }
    // Split tensors are distinct on every tensor rank and stage: their squares add up over
    // the model-parallel group. Replicated ones are equal on tensor ranks: counted once.
    // The collectives need the device of the gradients (NCCL takes CUDA tensors only).
    const at::Device device = adapter->parameters().empty() ? at::Device(at::kCPU)
                                                            : adapter->parameters()[0].main_grad.device();
    at::Tensor sq = SumOfSquares(split, device);
    for (const Parameter& p : adapter->parameters()) {  // another stage counts its copy
      if (p.stage_copy) sq = sq - SumOfSquares(p.main_grad, device);
    }
    const bool count_replicated = groups == nullptr || groups->coords().tp == 0;
    if (count_replicated) sq = sq + SumOfSquares(partial, device) + SumOfSquares(full, device);
    sq = sq.reshape({1});
    if (groups != nullptr) {
      LORASTEP_RETURN_IF_ERROR(groups->group(GroupKind::kModelParallel).AllReduce(sq));
    }
    return std::sqrt(sq.item<double>());
  });
}

}  // namespace lorastep
