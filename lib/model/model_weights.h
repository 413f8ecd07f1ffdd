// The tensors of a Qwen2 decoder in Hugging Face layout, with loading from and saving to a
// Hugging Face folder (config.json + model.safetensors, or shards + model.safetensors.index.json),
// and a generator of randomly initialized models of any config.
#ifndef LORASTEP_LIB_MODEL_MODEL_WEIGHTS_H_
#define LORASTEP_LIB_MODEL_MODEL_WEIGHTS_H_

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/model/lora_config.h"
#include "lib/model/model_config.h"
#include "lib/parallel/parallel_layout.h"

namespace lorastep {

// Which tensors a decoder layer has (set from the config; names and shapes follow it).
struct LayerLayout {
  bool qkv_bias = true;   // Qwen2 and Qwen2-MoE attention
  bool qk_norm = false;   // Qwen3: RMSNorm over each query/key head before RoPE
  bool moe = false;       // routed experts: router + stacked expert weights
  // gate/up/down slots hold the dense MLP, or on a MoE layer Qwen2-MoE's shared expert.
  bool mlp_slots = true;
  bool shared_expert_gate = false;
  // gpt-oss: o_proj bias, attention sinks, router bias, expert biases, and its tensor names
  // (mlp.router, mlp.experts.*_bias).
  bool o_bias = false;
  bool sinks = false;
  bool gpt_oss = false;
  // Qwen3.5: a Gated DeltaNet layer (linear_attn.*: the five projection slots from kInProjQkv,
  // the convolution, A_log, dt_bias, the gated norm) in place of q/k/v/o.
  bool linear_attention = false;
  // Whether the layer's attention kind has linear `slot` (a LinearSlot): q/k/v/o or Gated
  // DeltaNet's five; the MLP slots always pass (mlp_slots and `moe` say what they hold).
  bool HasLinear(int slot) const {
    return IsMlpSlot(slot) || IsLinearAttentionSlot(slot) == linear_attention;
  }
};
LayerLayout LayoutOfLayer(const ModelConfig& config, int64_t layer);

struct LayerWeights {
  LayerLayout layout;
  at::Tensor input_norm;                          // [H]
  std::array<at::Tensor, kNumLinearSlots> linear;  // [out, in], indexed by LinearSlot
  std::array<at::Tensor, 3> qkv_bias;              // q, k, v biases (when layout.qkv_bias)
  at::Tensor q_norm, k_norm;                       // [head_dim] (when layout.qk_norm)
  at::Tensor post_attention_norm;                 // [H]
  // Routed experts (layout.moe), in transformers' in-memory layout.
  at::Tensor router;             // [E, H]: mlp.gate.weight
  at::Tensor experts_gate_up;    // [E, 2I, H]: gate rows, then up rows
  at::Tensor experts_down;       // [E, H, I]
  at::Tensor shared_expert_gate;  // [1, H] (Qwen2-MoE)
  // gpt-oss (layout.gpt_oss): o_proj's bias [H], the sink logit of each query head [heads],
  // the router's bias [E], and the experts' biases in the same layout as their weights.
  at::Tensor o_bias, sinks, router_bias;
  at::Tensor experts_gate_up_bias;  // [E, 2I]: gate, then up
  at::Tensor experts_down_bias;     // [E, H]
  // Qwen3.5's Gated DeltaNet (layout.linear_attention): conv1d [C, 1, K] (C: q, k and v
  // channels), A_log and dt_bias [value heads], the gated norm's weight [value head dim].
  at::Tensor conv1d, a_log, dt_bias, linear_norm;
};

struct ModelWeights {
  at::Tensor embed_tokens;  // [V, H]
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;  // [H]
  at::Tensor lm_head;     // [V, H]; undefined when tied to embed_tokens
  int64_t first_layer = 0;  // global index of layers[0] (a pipeline stage holds a range)

  const at::Tensor& output_weight() const { return lm_head.defined() ? lm_head : embed_tokens; }
};

// Visits every tensor with its Hugging Face name ("model.layers.3.mlp.up_proj.weight"), in a
// fixed order. Undefined tensors (a tied lm_head) are skipped.
void ForEachNamedTensor(ModelWeights& weights,
                        const std::function<void(const std::string&, at::Tensor&)>& fn);
void ForEachNamedTensor(const ModelWeights& weights,
                        const std::function<void(const std::string&, const at::Tensor&)>& fn);

// Expected shape of every named tensor for `config`.
std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedTensorShapes(
    const ModelConfig& config);

struct LoadedModel {
  ModelConfig config;
  ModelWeights weights;
};

// Loads a Hugging Face folder onto `device` in `dtype` (default: config.torch_dtype).
// Missing tensors and shape mismatches are INVALID_ARGUMENT naming the tensor. Routed
// experts load from either layout transformers writes: stacked
// (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) or one module
// per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what save_pretrained writes).
// gpt-oss stores its experts [E, in, out] with gate and up columns interleaved
// (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H], biases alike), or MXFP4-quantized as
// `*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32]: both are brought to the
// layout above (gate rows, then up rows) at load, and SaveModel writes the first form back.
absl::StatusOr<LoadedModel> LoadModel(const std::string& folder, const at::Device& device,
                                      c10::optional<at::ScalarType> dtype = c10::nullopt);

// Writes config.json + model.safetensors (or `shards` files + index when shards > 1).
absl::Status SaveModel(const std::string& folder, const ModelConfig& config,
                       const ModelWeights& weights, int shards = 1);

// This rank's part of `full`: the stage's layers (layers[0] is global layer
// shard.layer_begin), linears cut as LinearSplitOf says (q/k/v biases with their rows),
// embedding and LM head cut by vocabulary rows; norms whole. Copies (the full model can be
// freed). A whole shard returns `full` itself.
ModelWeights ShardModelWeights(const ModelWeights& full, const ModelConfig& config,
                               const ModelShard& shard);

// Tensor rank `tp_rank`'s part (of `tp`) of `whole` as `split` cuts a linear: the range
// [begin, end) of dim split.dim, or each group's even share, in group order (split.groups).
at::Tensor CutLinearSplit(const at::Tensor& whole, const LinearSplit& split, int tp, int tp_rank);
// The whole tensor from every tensor rank's part (in rank order) of a grouped split along `dim`
// (LinearSplit::groups; Parameter::split_groups): group by group, rank by rank.
at::Tensor JoinGroupedSplit(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& groups, int dim);

// A model of `config` whose tensors are shape-only (meta device): the names and shapes
// every loader and generator fills.
ModelWeights ModelSkeleton(const ModelConfig& config);

// Random weights (normal(0, 0.02) matrices, norms near 1, small biases), deterministic in
// `seed`, made on CPU in config.torch_dtype.
// Stores each layer's q/k/v weights (and biases) and gate/up weights back to back in one
// buffer per group, leaving the slots as views into it, so that the layer can run each
// group as one GEMM (LoraLinearGroup); values are unchanged. A group with a missing member
// (a MoE layer without a shared expert) stays as it is.
//
// gate/up's buffer leaves `spare_columns` zero columns after each row (the weights are then
// row-strided views, SpareColumns): a LoRA fold writes its scaled B there and runs
// [x | x A^T] @ [W | s B]^T over the buffer itself, instead of a copy of W per call
// (LoraLinearGroup). kFoldSpareColumns covers gate/up's branches up to rank 64.
inline constexpr int64_t kFoldSpareColumns = 128;
void PackProjections(ModelWeights* weights, int64_t spare_columns = kFoldSpareColumns);

ModelWeights RandomModelWeights(const ModelConfig& config, uint64_t seed);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_MODEL_WEIGHTS_H_
