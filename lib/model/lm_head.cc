// The LM head's scores of a decoder's final hidden states (Qwen2HeadScores, lib/model/qwen2.h):
// the frozen head, the trainable one (full fine-tuning), or the frozen head plus its LoRA.
#include "lib/model/qwen2.h"

namespace lorastep {
namespace {

const at::Tensor& OutputWeight(const ModelWeights& base, const Adapter* adapter) {
  if (adapter != nullptr && adapter->full_finetune()) return adapter->full_weights().output_weight();
  return base.output_weight();
}

at::Tensor OutputMainGrad(const Adapter* adapter) {
  if (adapter != nullptr && adapter->full_finetune()) return adapter->full_main_grads().output_weight();
  return at::Tensor();
}

}  // namespace

TokenScores Qwen2HeadScores(const ModelWeights& base, const Adapter* adapter, const at::Tensor& hidden,
                            const at::Tensor& targets, int64_t chunk_tokens, const ForwardOptions& options,
                            const VocabShard& vocab, bool entropy_grad) {
  const LoraFactors* f = adapter != nullptr ? adapter->head_lora() : nullptr;
  if (f == nullptr) {
    return ChunkedTokenScores(hidden, OutputWeight(base, adapter), OutputMainGrad(adapter), targets,
                              chunk_tokens, options.grad, vocab, entropy_grad);
  }
  const Parameter& a = adapter->parameters()[f->a];
  const Parameter& b = adapter->parameters()[f->b];
  const double p = adapter->lora_config().dropout;
  const at::Tensor xin = p > 0 && options.training ? LoraDropout(hidden, p, options.dropout_generator) : hidden;
  // A's gradient through the Linear (into its main_grad); B's inside the chunked head.
  const at::Tensor u = Linear(xin, a.value, a.main_grad, options.grad) * adapter->lora_config().scale();
  const at::Tensor weight = at::cat({base.output_weight(), b.value.detach()}, 1);
  return ChunkedTokenScores(at::cat({hidden, u}, 1), weight, b.main_grad, targets, chunk_tokens, options.grad,
                            vocab, entropy_grad, /*trainable_from_col=*/hidden.size(1));
}

}  // namespace lorastep
