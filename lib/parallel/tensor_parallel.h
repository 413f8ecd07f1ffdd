// Tensor-parallel building blocks (Megatron-LM's mappings) over a CommGroup, as autograd
// functions. With a null group (or a group of size 1) each is the identity.
//
//   CopyToTensorRegion(x):     forward identity; backward SUM all-reduce of the gradient.
//                              Put before column-parallel linears: each rank's partial
//                              input gradient (from its output slice) adds up.
//   ReduceFromTensorRegion(x): forward SUM all-reduce; backward identity. After
//                              row-parallel linears, whose outputs are partial sums.
//
// Collectives run synchronously on the calling thread; a failure throws StatusError, which
// GuardTorch at the lib/ boundary turns back into the status (DEADLINE_EXCEEDED, ...).
// Every tensor rank calls these in the same order (same model, same micro-batches).
#ifndef LORASTEP_LIB_PARALLEL_TENSOR_PARALLEL_H_
#define LORASTEP_LIB_PARALLEL_TENSOR_PARALLEL_H_

#include <ATen/ATen.h>

#include <vector>

#include "lib/parallel/process_groups.h"

namespace lorastep {

at::Tensor CopyToTensorRegion(const at::Tensor& x, CommGroup* group);
at::Tensor ReduceFromTensorRegion(const at::Tensor& x, CommGroup* group);

// Expert-parallel token exchange: rows of x go to the group's members (input_splits[j] to
// member j), the rows received come back in member order (output_splits[j] from member j).
// Backward sends the gradients the opposite way. Identity on a trivial group.
at::Tensor AllToAllRows(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& input_splits,
                        const std::vector<int64_t>& output_splits);

// Embedding lookup with the vocabulary split over the group: this rank holds rows
// [vocab_begin, vocab_begin + weight.size(0)); tokens outside give zeros, and the SUM
// all-reduce assembles every token's row.
at::Tensor VocabParallelEmbedding(const at::Tensor& weight, const at::Tensor& tokens,
                                  int64_t vocab_begin, CommGroup* group);

// The vocabulary slice of the LM head this rank holds, for vocab-parallel log-probs.
struct VocabShard {
  CommGroup* group = nullptr;  // null: the whole vocabulary is local
  int64_t begin = 0;           // first vocabulary row of this rank
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARALLEL_TENSOR_PARALLEL_H_
