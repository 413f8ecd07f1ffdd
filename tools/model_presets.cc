#include "tools/model_presets.h"

#include "absl/strings/str_cat.h"

namespace lorastep {

namespace {

// gpt-oss's YaRN: beta_fast 32, beta_slow 1, the correction range not rounded.
RopeConfig GptOssRope(double factor, int64_t original) {
  RopeConfig r;
  r.type = "yarn";
  r.factor = factor;
  r.beta_fast = 32;
  r.beta_slow = 1;
  r.truncate = false;
  r.original_max_position_embeddings = original;
  return r;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigPreset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    c.vocab_size = 96;
    c.hidden_size = 32;
    c.intermediate_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 512;
    c.rope_theta = 10000.0;
    c.torch_dtype = "float32";
  } else if (name == "small") {
    c.vocab_size = 512;
    c.hidden_size = 128;
    c.intermediate_size = 352;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 2048;
    c.torch_dtype = "float32";
  } else if (name == "qwen2.5-0.5b") {
    c.vocab_size = 151936;
    c.hidden_size = 896;
    c.intermediate_size = 4864;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 14;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 32768;
    c.rope_theta = 1000000.0;
    c.torch_dtype = "bfloat16";
  } else if (name == "tiny-moe") {
    c = ModelConfigPreset("tiny").value();  // tiny's attention, routed experts in every layer
    c.model_type = "qwen2_moe";
    c.moe.num_experts = 4;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 16;
    c.moe.norm_topk_prob = true;
    c.moe.shared_expert_intermediate_size = 32;
  } else if (name == "tiny-qwen3-moe") {
    c = ModelConfigPreset("tiny-moe").value();  // same widths; Qwen3's attention, no shared expert
    c.model_type = "qwen3_moe";
    c.head_dim_override = 16;
    c.tie_word_embeddings = false;
    c.moe.shared_expert_intermediate_size = 0;
    c.moe.mlp_only_layers = {0};
  } else if (name == "qwen3-30b-a3b-reduced") {
    c.model_type = "qwen3_moe";
    c.vocab_size = 151936;
    c.hidden_size = 2048;
    c.intermediate_size = 6144;
    c.num_hidden_layers = 4;  // 48 in the full model
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim_override = 128;
    c.max_position_embeddings = 40960;
    c.rope_theta = 1000000.0;
    c.tie_word_embeddings = false;
    c.torch_dtype = "bfloat16";
    c.moe.num_experts = 128;
    c.moe.num_experts_per_tok = 8;
    c.moe.moe_intermediate_size = 768;
    c.moe.norm_topk_prob = true;
  } else if (name == "tiny-qwen3") {
    c = ModelConfigPreset("tiny").value();  // Qwen3's attention: q/k norms, no biases, head_dim given
    c.model_type = "qwen3";
    c.head_dim_override = 16;
  } else if (name == "tiny-qwen2-swa") {
    c = ModelConfigPreset("tiny").value();  // its second layer in a sliding window of 4 positions
    c.sliding_window = 4;
    c.sliding_layers = {false, true};
  } else if (name == "tiny-gpt-oss") {
    c = ModelConfigPreset("tiny").value();  // gpt-oss's shape at tiny's size: layer 0 slides (window 4)
    c.model_type = "gpt_oss";
    c.head_dim_override = 16;  // 4 heads x 16 != hidden 32
    c.tie_word_embeddings = false;
    c.rms_norm_eps = 1e-5;
    c.intermediate_size = 16;
    c.moe.num_experts = 4;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 16;
    c.moe.norm_topk_prob = true;
    c.sliding_window = 4;
    c.sliding_layers = {true, false};
    c.rope = GptOssRope(4, 128);
  } else if (name == "tiny-qwen3.5") {
    c = ModelConfigPreset("tiny").value();  // Qwen3.5's hybrid at tiny's size: Gated DeltaNet, then full attention
    c.model_type = "qwen3_5_text";
    c.head_dim_override = 16;
    c.partial_rotary_factor = 0.25;
    c.tie_word_embeddings = false;
    c.linear_layers = {true, false};
    c.linear_attention.conv_kernel = 4;
    c.linear_attention.key_head_dim = 8;
    c.linear_attention.value_head_dim = 8;
    c.linear_attention.num_key_heads = 2;
    c.linear_attention.num_value_heads = 4;
  } else if (name == "tiny-qwen3.5-moe") {
    c = ModelConfigPreset("tiny-qwen3.5").value();  // Qwen3.5-MoE: routed experts and a gated shared expert
    c.model_type = "qwen3_5_moe_text";
    c.moe.num_experts = 4;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 16;
    c.moe.shared_expert_intermediate_size = 32;
    c.moe.norm_topk_prob = true;
    c.intermediate_size = 16;
  } else if (name == "qwen3.5-9b") {
    c.model_type = "qwen3_5_text";  // Qwen3_5TextConfig's defaults (its Qwen3.5-9B-style shape)
    c.vocab_size = 248320;
    c.hidden_size = 4096;
    c.intermediate_size = 12288;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 4;
    c.head_dim_override = 256;
    c.max_position_embeddings = 32768;
    c.rope_theta = 10000000;
    c.partial_rotary_factor = 0.25;
    c.tie_word_embeddings = false;
    c.torch_dtype = "bfloat16";
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.linear_layers.push_back((i + 1) % 4 != 0);
  } else if (name == "gpt-oss-20b-reduced") {
    c.model_type = "gpt_oss";  // gpt-oss-20b's widths, 4 of its 24 layers
    c.vocab_size = 201088;
    c.hidden_size = 2880;
    c.intermediate_size = 2880;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 64;
    c.num_key_value_heads = 8;
    c.head_dim_override = 64;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 150000;
    c.tie_word_embeddings = false;
    c.torch_dtype = "bfloat16";
    c.moe.num_experts = 32;
    c.moe.num_experts_per_tok = 4;
    c.moe.moe_intermediate_size = 2880;
    c.moe.norm_topk_prob = true;
    c.sliding_window = 128;
    c.sliding_layers = {true, false, true, false};
    c.rope = GptOssRope(32, 4096);
  } else if (name == "tiny-llama") {
    c = ModelConfigPreset("tiny").value();  // Llama 3.1's RoPE, untied head
    c.model_type = "llama";
    c.tie_word_embeddings = false;
    c.rope.type = "llama3";
    c.rope.factor = 8;
    c.rope.original_max_position_embeddings = 64;  // tiny: the smoothing touches the test's lengths
  } else if (name == "qwen3-0.6b" || name == "qwen3-8b") {
    const bool small = name == "qwen3-0.6b";
    c.model_type = "qwen3";
    c.vocab_size = 151936;
    c.hidden_size = small ? 1024 : 4096;
    c.intermediate_size = small ? 3072 : 12288;
    c.num_hidden_layers = small ? 28 : 36;
    c.num_attention_heads = small ? 16 : 32;
    c.num_key_value_heads = 8;
    c.head_dim_override = 128;
    c.max_position_embeddings = 40960;
    c.rope_theta = 1000000.0;
    c.tie_word_embeddings = small;
    c.torch_dtype = "bfloat16";
  } else if (name == "llama-3.2-1b" || name == "llama-3.1-8b") {
    const bool small = name == "llama-3.2-1b";
    c.model_type = "llama";
    c.vocab_size = 128256;
    c.hidden_size = small ? 2048 : 4096;
    c.intermediate_size = small ? 8192 : 14336;
    c.num_hidden_layers = small ? 16 : 32;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim_override = small ? 64 : 128;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.tie_word_embeddings = small;
    c.torch_dtype = "bfloat16";
    c.rope.type = "llama3";
    c.rope.factor = small ? 32 : 8;
    c.rope.original_max_position_embeddings = 8192;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("preset: unknown model preset '", name, "'"));
  }
  return c;
}

}  // namespace lorastep
