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

struct LayerWeights {
  at::Tensor input_norm;                          // [H]
  std::array<at::Tensor, kNumLinearSlots> linear;  // [out, in], indexed by LinearSlot
  std::array<at::Tensor, 3> qkv_bias;              // q, k, v biases
  at::Tensor post_attention_norm;                 // [H]
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
// Missing tensors and shape mismatches are INVALID_ARGUMENT naming the tensor.
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

// Random weights (normal(0, 0.02) matrices, norms near 1, small biases), deterministic in
// `seed`, made on CPU in config.torch_dtype.
ModelWeights RandomModelWeights(const ModelConfig& config, uint64_t seed);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_MODEL_WEIGHTS_H_
