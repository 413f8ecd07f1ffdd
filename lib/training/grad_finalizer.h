// The one gradient-finalization point between backward and the optimizer, in two parts:
//
//  1. FoldLocalGradients, after each backward (local, no communication): autograd-visible
//     gradients (the unfused path, and parameters without a custom backward: embeddings,
//     norms, biases) are added into each Parameter's fp32 main_grad exactly once and cleared.
//  2. FinalizeStepGradients, once per optimizer step (collective; every rank of the mesh
//     calls it in the same order): the tensor-replicated bucket (LoRA factors on the unsplit
//     side of a split linear: each tensor rank holds a partial gradient) is SUM all-reduced
//     over the stage's tensor+data group -- exactly once, the second seed's fix in its dense
//     form -- and the split bucket over the data group. Each bucket is one contiguous fp32
//     buffer, so each reduction is one collective. Then the global gradient norm: squares of
//     split tensors summed over the model-parallel group, replicated tensors counted once,
//     so every rank clips by the same factor.
//
// With k ForwardBackward calls before one OptimStep, part 1 runs k times and part 2 once:
// the reductions never repeat.
#ifndef LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_
#define LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_

#include "absl/status/statusor.h"
#include "lib/model/adapter.h"
#include "lib/parallel/process_groups.h"

namespace lorastep {

absl::Status FoldLocalGradients(Adapter* adapter);

struct GradFinalizeOptions {
  // Test only: how many times the tensor-replicated bucket is reduced over the stage group.
  // 1 is correct; 0 reproduces the second seed's bug (replicas drift apart from the second
  // update), 2 a doubled reduction. Both must be caught by the replica and norm checks.
  int replicated_reductions = 1;
};

// `groups` null = world size 1 (no communication). Returns the global L2 norm of all
// main_grads after reduction, identical on every rank.
absl::StatusOr<double> FinalizeStepGradients(Adapter* adapter, ProcessGroups* groups,
                                             const GradFinalizeOptions& options = {});

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_
