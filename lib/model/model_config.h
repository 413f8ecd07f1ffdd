// Shape of a decoder (Qwen2 / Qwen2.5 / Qwen3 / Llama, their MoE variants and gpt-oss), read
// from (and written as) a Hugging Face config.json.
#ifndef LORASTEP_LIB_MODEL_MODEL_CONFIG_H_
#define LORASTEP_LIB_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lorastep {

// Routed-expert (MoE) MLP settings, as transformers' Qwen2-MoE / Qwen3-MoE configs name them
// (gpt-oss: num_local_experts and intermediate_size). num_experts 0: every layer is a dense MLP.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;     // top-k of the router's softmax
  int64_t moe_intermediate_size = 0;   // each expert's SwiGLU width
  bool norm_topk_prob = false;         // renormalize the top-k probabilities to sum to 1
  int64_t decoder_sparse_step = 1;     // MoE on layers with (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... except these, which stay dense
  // Qwen2-MoE's shared expert (always on, gated by sigmoid(x . w)); 0 = none (Qwen3-MoE).
  int64_t shared_expert_intermediate_size = 0;
  // gpt-oss's experts: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
  // g = min(gate, limit), in place of SiLU(gate) * up (ModelConfig::clamped_swiglu()).
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
};

// Rotary position embedding as transformers computes it for `type` (its rope_type): the
// inverse frequencies, and a scale on cos and sin (yarn's attention factor).
struct RopeConfig {
  std::string type = "default";  // "default", "linear", "dynamic", "yarn", "llama3"
  double factor = 1;             // linear, dynamic, yarn, llama3
  int64_t original_max_position_embeddings = 0;  // yarn, dynamic, llama3; 0: not given
  double low_freq_factor = 1, high_freq_factor = 4;  // llama3
  double beta_fast = 32, beta_slow = 1;              // yarn
  double attention_factor = 0;                        // yarn; 0: not given (from the factor)
  bool truncate = true;                               // yarn: round the correction range outwards
};

// Qwen3.5's linear-attention (Gated DeltaNet) layers, as transformers names the settings
// (linear_conv_kernel_dim, linear_key_head_dim, ...).
struct LinearAttentionConfig {
  int64_t conv_kernel = 4;
  int64_t key_head_dim = 128, value_head_dim = 128;
  int64_t num_key_heads = 16, num_value_heads = 32;
  int64_t key_dim() const { return key_head_dim * num_key_heads; }
  int64_t value_dim() const { return value_head_dim * num_value_heads; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // q, k and v through the convolution
  // Weights of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj for hidden size h.
  int64_t projection_parameters(int64_t h) const {
    return h * (conv_dim() + value_dim() + 2 * num_value_heads) + value_dim() * h;
  }
};

struct ModelConfig {
  // Dense: "qwen2" (Qwen2, Qwen2.5), "qwen3", "llama" (Llama 3.x); MoE: "qwen2_moe",
  // "qwen3_moe", "gpt_oss"; hybrid linear attention: "qwen3_5_text" (Qwen3.5 dense),
  // "qwen3_5_moe_text" (Qwen3.5-MoE).
  std::string model_type = "qwen2";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // SwiGLU width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // grouped-query attention: heads share K/V in groups
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;          // RoPE base
  bool tie_word_embeddings = true;  // LM head reuses the embedding matrix
  std::string torch_dtype = "bfloat16";  // "float32", "float16" or "bfloat16"
  int64_t head_dim_override = 0;  // Qwen3's explicit head_dim; 0 = hidden_size / heads
  RopeConfig rope;
  MoeConfig moe;
  // Sliding-window attention (transformers' layer_types, or Qwen's use_sliding_window,
  // sliding_window and max_window_layers): in a sliding layer, query i sees keys
  // i - sliding_window < j <= i. Empty: every layer attends to its whole sequence.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;  // per decoder layer
  // Qwen3.5: which layers are Gated DeltaNet (true) and which full attention, their settings,
  // and the share of each attention head's dimensions RoPE rotates (the first ones).
  std::vector<bool> linear_layers;
  LinearAttentionConfig linear_attention;
  double partial_rotary_factor = 1.0;
  // A vision-language folder's text model (Qwen3.5's qwen3_5 / qwen3_5_moe): its tensors sit
  // under "model.language_model." instead of "model."; the vision tower is not loaded.
  bool language_model_of_vl = false;
  // How the folder's routed-expert weights are stored: "" (bf16/fp16/fp32 tensors) or
  // "mxfp4" (gpt-oss's blocks and scales, dequantized at load).
  std::string quantization;

  // Biases on q/k/v (Qwen2's and gpt-oss's attention), RMSNorm on each head's q and k (Qwen3's).
  bool qkv_bias() const { return model_type == "qwen2" || model_type == "qwen2_moe" || gpt_oss(); }
  bool qk_norm() const { return model_type == "qwen3" || model_type == "qwen3_moe" || qwen3_5(); }
  bool moe_family() const {
    return model_type == "qwen2_moe" || model_type == "qwen3_moe" || gpt_oss() || model_type == "qwen3_5_moe_text";
  }
  // gpt-oss: a bias on o_proj too; a learned logit per query head that joins each softmax's
  // denominator (the attention sink); a router with a bias; experts with biases, stored
  // [E, in, out] with gate and up columns interleaved, through the clamped SwiGLU.
  bool gpt_oss() const { return model_type == "gpt_oss"; }
  bool o_bias() const { return gpt_oss(); }
  bool attention_sinks() const { return gpt_oss(); }
  bool router_bias() const { return gpt_oss(); }
  bool expert_bias() const { return gpt_oss(); }
  bool clamped_swiglu() const { return gpt_oss(); }
  // Qwen3.5: RMSNorm weights stored as offsets from 1 (the norm multiplies by 1 + w), and
  // full attention whose q_proj also gives a per-head output gate (sigmoid, before o_proj).
  bool qwen3_5() const { return model_type == "qwen3_5_text" || model_type == "qwen3_5_moe_text"; }
  bool zero_centered_norm() const { return qwen3_5(); }
  bool gated_attention() const { return qwen3_5(); }
  bool IsLinearAttentionLayer(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(linear_layers.size()) && linear_layers[layer];
  }
  bool HasLinearAttention() const {
    for (bool l : linear_layers) {
      if (l) return true;
    }
    return false;
  }
  // The output width of a Gated DeltaNet projection (a LinearSlot from kInProjQkv on; out_proj:
  // its input width).
  int64_t LinearAttentionWidth(int slot) const;
  // The dimensions of each head RoPE rotates (partial rotary: the first ones).
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim()) * partial_rotary_factor);
  }

  int64_t head_dim() const {
    return head_dim_override > 0 ? head_dim_override : hidden_size / num_attention_heads;
  }
  bool is_moe() const { return moe.num_experts > 0; }
  // The keys a query of decoder layer `layer` sees (itself included); 0: all before it.
  int64_t AttentionWindow(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[layer] ? sliding_window
                                                                                                       : 0;
  }
  bool HasSlidingLayers() const {
    for (bool s : sliding_layers) {
      if (s) return true;
    }
    return false;
  }
  // Whether decoder layer `layer` has routed experts (transformers' rule).
  bool IsMoeLayer(int64_t layer) const;
  // Parameters that enter a matmul per token (the 'M' of 6M / 4M FLOPs), LM head included.
  int64_t MatmulParameterCount() const;
  // Every parameter, embeddings and norms included (tied embeddings counted once).
  int64_t TotalParameterCount() const;
};

// Validates fields and their relations; errors name the field.
absl::Status ValidateModelConfig(const ModelConfig& config);
// Parses a Hugging Face config.json text; every key is accounted for (docs/API.md).
absl::StatusOr<ModelConfig> ParseModelConfigJson(const std::string& json_text);
// Serializes to a Hugging Face config.json that transformers' class of the family loads.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_MODEL_CONFIG_H_
