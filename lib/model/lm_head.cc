// The LM head's scores (Qwen2HeadScores) and logits (Qwen2HeadLogits) of a decoder's final
// hidden states (lib/model/qwen2.h):
// the frozen head, the trainable one (full fine-tuning), or the frozen head plus its LoRA.
#include "lib/model/qwen2.h"

#include <algorithm>
#include <vector>

#include "lib/parallel/parallel_layout.h"
#include "lib/torch_status.h"

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

at::Tensor Qwen2HeadLogits(const ModelWeights& base, const Adapter* adapter, const at::Tensor& hidden,
                           const VocabShard& vocab, int64_t vocab_size) {
  const LoraFactors* f = adapter != nullptr ? adapter->head_lora() : nullptr;
  at::Tensor logits;
  if (f == nullptr) {
    logits = at::mm(hidden, OutputWeight(base, adapter).t());
  } else {
    const at::Tensor& a = adapter->parameters()[f->a].value;
    const at::Tensor& b = adapter->parameters()[f->b].value;
    const at::Tensor u = at::mm(hidden, a.t()) * adapter->lora_config().scale();
    logits = at::mm(at::cat({hidden, u}, 1), at::cat({base.output_weight(), b}, 1).t());
  }
  logits = logits.to(at::kFloat);
  if (vocab.group == nullptr || vocab.group->size() == 1) return logits;
  // The shares differ by at most one row: each is padded to the widest for the all-gather.
  const int members = vocab.group->size();
  const int64_t widest = EvenRange(vocab_size, members, 0).second;
  at::Tensor padded = logits;
  if (logits.size(1) < widest) {
    padded = at::cat({logits, at::zeros({logits.size(0), widest - logits.size(1)}, logits.options())}, 1);
  }
  absl::StatusOr<std::vector<at::Tensor>> gathered = vocab.group->AllGather(padded.contiguous());
  ThrowIfError(gathered.status());
  std::vector<at::Tensor>& parts = *gathered;
  for (int j = 0; j < members; ++j) {
    const auto [begin, end] = EvenRange(vocab_size, members, j);
    parts[j] = parts[j].narrow(1, 0, end - begin);
  }
  return at::cat(parts, 1);
}

}  // namespace lorastep
