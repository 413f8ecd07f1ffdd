// The Qwen2 / Qwen2.5 decoder forward: RMSNorm, RoPE, grouped-query causal attention with
// q/k/v bias, SwiGLU MLP, residuals, final norm. Base weights are frozen; an Adapter adds
// LoRA branches (or, with rank 0, replaces the weights with trainable ones).
// Every matmul with a weight goes through lib/model/linear.h (one 2-D GEMM each way).
#ifndef LORASTEP_LIB_MODEL_QWEN2_H_
#define LORASTEP_LIB_MODEL_QWEN2_H_

#include <ATen/ATen.h>

#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "lib/model/adapter.h"
#include "lib/model/gated_delta.h"
#include "lib/model/layer_ops.h"
#include "lib/model/linear.h"
#include "lib/model/logprobs.h"
#include "lib/model/layer_recompute.h"
#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/tensor_parallel.h"

namespace lorastep {

// Sequences packed back to back in one row, without padding: the layers see x as
// [1, total, H]; each sequence attends only within itself and RoPE uses each token's
// position in its own sequence.
struct PackedSequences {
  at::Tensor cu_seqlens;         // int32 [count + 1] on the device: starts, then the total
  at::Tensor positions;          // int64 [total] on the device: position within the sequence
  std::vector<int64_t> lengths;  // host copy of the lengths (attention without varlen kernels)
  int64_t max_length = 0;
  // Context parallelism: this row holds only this rank's tokens of the sequences
  // (ContextShardTokens); attention runs over `context_group` (ContextParallelAttention),
  // `sequence_ids` [total] int64 naming each token's sequence and `context_counts` every
  // rank's token count. Null group: the row holds the whole sequences.
  CommGroup* context_group = nullptr;
  at::Tensor sequence_ids;
  std::vector<int64_t> context_counts;
  // Context parallelism, for layers that need whole sequences (Gated DeltaNet): this rank's
  // tokens' positions in the whole packed row (int64 [t]), and for each position of the
  // whole row its row in the group's gather (GatherContextRows order; int64 [whole total]).
  at::Tensor context_tokens;
  at::Tensor context_order;
};

// One run's tokens in a forward shared by several runs of the same base (co-scheduling):
// rows [begin, end) of the packed row carry `adapter`'s LoRA and draw LoRA dropout from
// `dropout_generator` (may be null without dropout).
struct RunSegment {
  const Adapter* adapter = nullptr;
  int64_t begin = 0, end = 0;
  at::Generator* dropout_generator = nullptr;
};

// Attention over keys and values cached from earlier forwards (the sampler's prefill and
// decode): the layers hand each layer's q, k and v of the packed row to it instead of
// attending within the row. Its implementation keeps this rank's key/value heads.
class CachedAttention {
 public:
  virtual ~CachedAttention() = default;
  // q [1, T, heads, d], k/v [1, T, kv_heads, d] (RoPE applied) of decoder layer `layer`
  // (its index in the model) -> [1, T, heads * d]. `sinks` [heads]: gpt-oss's sink logits
  // (joining each softmax's denominator), undefined for other models.
  virtual at::Tensor Attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& sinks) = 0;
};

struct ForwardOptions {
  GradOptions grad;
  bool training = true;  // LoRA dropout is active only while training
  // Draws LoRA dropout masks (on CPU, so a run's stream is its own and device-independent).
  at::Generator* dropout_generator = nullptr;
  // Tensor parallelism: the weights (and the adapter) hold this rank's shard; q/k/v/gate/up
  // are column-parallel, o/down row-parallel, the embedding vocab-parallel (Megatron).
  // Null shard or group: the whole model.
  const ModelShard* shard = nullptr;
  CommGroup* tensor_group = nullptr;
  // Expert parallelism: this rank holds experts [shard->expert_begin, shard->expert_end);
  // routed tokens are exchanged over this group (all-to-all). Null: every expert is local.
  CommGroup* expert_group = nullptr;
  // Routed experts through grouped GEMMs where the build and device have them (CUDA, bf16);
  // false forces the per-expert loop (tests compare the two).
  bool grouped_experts = true;
  // Each MoE layer's tokens per expert ([E] int64, on the device) are appended here when
  // set; AddRoutingMetrics turns them into figures with one host synchronization.
  std::vector<at::Tensor>* routing_counts = nullptr;
  // Packed sequences (tokens [1, total]); null: tokens [b, s], right-padded.
  const PackedSequences* packed = nullptr;
  // Where packed LoRA groups keep their parameter-only operands for the length of one call
  // (every micro-batch reuses them); null: built in each forward.
  LoraGroupOperandCache* lora_operands = nullptr;
  // Activation recomputation of the decoder layers in training (RecomputedLayerNode): the
  // same results for a second forward of the layers.
  LayerRecompute recompute_layers = LayerRecompute::kNone;
  // In training, Gated DeltaNet layers' chunked rules keep their intermediates for backward;
  // false: each keeps only its inputs and runs again in its backward (less memory, one more
  // forward of the rule). The same results either way.
  bool keep_linear_attention_rule = false;
  // Several runs' LoRA over one packed row (issue 30's co-scheduling): each projection runs
  // the frozen base over every row and each segment's LoRA branch over its own rows, so a
  // run's hidden states and gradients are those of the run alone. Needs `packed`, a null
  // `adapter`, segments covering the row in order, dense layers and no recomputation; the
  // LM head is scored per run (Qwen2HeadScores with its own adapter on its rows).
  const std::vector<RunSegment>* run_segments = nullptr;
  // Asked before each decoder layer and, in training, as each layer's output gradient arrives
  // in backward; true stops the pass by throwing LayersCancelled (through autograd in
  // backward), which the caller that set it catches. Null: never asked.
  const std::function<bool()>* cancelled = nullptr;
  // Attention through a cache (no grad; needs `packed`, whose positions are each token's
  // position in its whole sequence). Null: attention within the row.
  CachedAttention* cached_attention = nullptr;
  // The packed sequences' states in the linear-attention layers (the sampler's, with
  // cached_attention): each continues from its state and leaves the new one. Null: each
  // sequence starts from zeros.
  RecurrentStates* recurrent_states = nullptr;
};

// What Qwen2Layers throws when ForwardOptions::cancelled says stop.
struct LayersCancelled : std::runtime_error {
  LayersCancelled() : std::runtime_error("the call was cancelled inside the decoder layers") {}
};

// tokens: int64 [b, s] (right-padded; causal attention keeps padding out of real positions).
// Returns the final-normed hidden states [b, s, H] (the same on every tensor rank).
// `adapter` may be null (base model only).
at::Tensor Qwen2Hidden(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                       const at::Tensor& tokens, const ForwardOptions& options);

// The three pieces of Qwen2Hidden, for pipeline stages: the first stage embeds, every stage
// runs its layers (weights.layers: this stage's range), the last applies the final norm.
at::Tensor Qwen2Embed(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                      const at::Tensor& tokens, const ForwardOptions& options);
at::Tensor Qwen2Layers(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                       at::Tensor x, const ForwardOptions& options);
at::Tensor Qwen2FinalNorm(const ModelConfig& config, const ModelWeights& base,
                          const Adapter* adapter, const at::Tensor& x);

// Log-probs and entropies of `targets` under the LM head, for final-normed hidden states
// [T, H] (ChunkedTokenScores): the frozen head, the trainable one (full fine-tuning), or
// the frozen head plus its LoRA, logits = h W^T + scale (drop(h) A^T) B^T. The LoRA head is
// one product of [h, scale drop(h) A^T] with [W, B], so it chunks (and splits over the
// vocabulary) exactly like the plain head; only B's columns get a weight gradient.
TokenScores Qwen2HeadScores(const ModelWeights& base, const Adapter* adapter, const at::Tensor& hidden,
                            const at::Tensor& targets, int64_t chunk_tokens, const ForwardOptions& options,
                            const VocabShard& vocab, bool entropy_grad);

// The logits [T, V] (fp32, the whole vocabulary) of final hidden states [T, H] under the same
// head as Qwen2HeadScores (no dropout, no grad). With the vocabulary split over `vocab.group`
// (`vocab_size` rows in all, EvenRange shares), each rank computes its share and one
// all-gather assembles the rows on every rank.
at::Tensor Qwen2HeadLogits(const ModelWeights& base, const Adapter* adapter, const at::Tensor& hidden,
                           const VocabShard& vocab, int64_t vocab_size);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_QWEN2_H_
