// The one gradient-finalization point between backward and the optimizer.
//
// Today (world size 1) it folds autograd-visible gradients (the unfused path, and parameters
// without a custom backward: embeddings, norms, biases) into each Parameter's fp32 main_grad,
// exactly once, and clears them. The parallel engine adds its collectives here: SUM
// all-reduce of replicated LoRA factors over the tensor+data group of a pipeline stage, then
// data-parallel reduction, with digests that fail the step closed (the second seed).
#ifndef LORASTEP_LIB_GRAD_FINALIZER_H_
#define LORASTEP_LIB_GRAD_FINALIZER_H_

#include "absl/status/status.h"
#include "lib/adapter.h"

namespace lorastep {

absl::Status FinalizeGradients(Adapter* adapter);

}  // namespace lorastep

#endif  // LORASTEP_LIB_GRAD_FINALIZER_H_
