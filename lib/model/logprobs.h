// Per-token log-probabilities and entropies of target tokens, computed in chunks of tokens so
// the fp32 [tokens, vocab] logits of a whole micro-batch never exist at once. Peak extra
// memory is O(chunk_tokens * vocab), independent of the micro-batch size.
// A frozen head (LoRA) computes what backward needs while each chunk's logits exist
// ([T, H] products), so backward never touches [T, V]; a trainable or vocab-parallel head
// keeps the hidden states and recomputes each chunk's logits in backward.
#ifndef LORASTEP_LIB_MODEL_LOGPROBS_H_
#define LORASTEP_LIB_MODEL_LOGPROBS_H_

#include <ATen/ATen.h>

#include "lib/model/linear.h"
#include "lib/parallel/tensor_parallel.h"

namespace lorastep {

struct TokenScores {
  at::Tensor logprobs;  // fp32 [T]
  at::Tensor entropy;   // fp32 [T]
};

// hidden: [T, H]; weight: [V, H] (the LM head); targets: int64 [T].
// Differentiable in hidden and, when `weight_main_grad` is defined, in weight (accumulated
// like a trainable linear, fused or not per `grad`).
// Vocab-parallel when `vocab.group` has several ranks: `weight` is this rank's vocabulary
// slice, targets stay global ids, every rank gets the same log-probs and entropies, and the
// gradient of `hidden` is summed over the group (full logits are never gathered).
// `entropy_grad`: whether the loss will differentiate the entropy (the frozen head then
// prepares that gradient too; a backward through the entropy without it is an error).
// `trainable_from_col` > 0: only weight columns [trainable_from_col, H) are trained (a
// frozen head widened by its LoRA factor B); `weight_main_grad` is their fp32 gradient
// [V, H - trainable_from_col], accumulated directly whatever `grad.fused_wgrad` says.
TokenScores ChunkedTokenScores(const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& weight_main_grad, const at::Tensor& targets,
                               int64_t chunk_tokens, const GradOptions& grad,
                               const VocabShard& vocab = {}, bool entropy_grad = true,
                               int64_t trainable_from_col = 0);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LOGPROBS_H_
