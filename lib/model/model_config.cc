#include "lib/model/model_config.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace lorastep {

int64_t ModelConfig::MatmulParameterCount() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim(),
                kv = num_key_value_heads * head_dim();
  int64_t total = vocab_size * h;  // LM head
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    total += 2 * h * q /*q,o*/ + 2 * h * kv /*k,v*/;
    if (!IsMoeLayer(layer)) {
      total += 3 * h * intermediate_size;  // gate, up, down
      continue;
    }
    // Per token: the router, top-k experts, and Qwen2-MoE's shared expert and its gate.
    total += moe.num_experts * h + moe.num_experts_per_tok * 3 * h * moe.moe_intermediate_size;
    if (moe.shared_expert_intermediate_size > 0) total += 3 * h * moe.shared_expert_intermediate_size + h;
  }
  return total;
}

int64_t ModelConfig::TotalParameterCount() const {
  const int64_t h = hidden_size, d = head_dim(), q = num_attention_heads * d,
                kv = num_key_value_heads * d;
  int64_t total = vocab_size * h /*embedding*/ + h /*final norm*/;
  if (!tie_word_embeddings) total += vocab_size * h;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    total += 2 * h * q + 2 * h * kv + 2 * h /*norms*/;
    total += model_type == "qwen3_moe" ? 2 * d /*q/k norms*/ : q + 2 * kv /*q,k,v bias*/;
    if (!IsMoeLayer(layer)) {
      total += 3 * h * intermediate_size;
      continue;
    }
    total += moe.num_experts * (h + 3 * h * moe.moe_intermediate_size);  // router + experts
    if (moe.shared_expert_intermediate_size > 0) total += 3 * h * moe.shared_expert_intermediate_size + h;
  }
  return total;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (!is_moe()) return false;
  for (int64_t dense : moe.mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % moe.decoder_sparse_step == 0;
}

namespace {

absl::Status ValidateMoeConfig(const ModelConfig& c) {
  const MoeConfig& m = c.moe;
  if (c.model_type == "qwen2") {
    if (m.num_experts != 0) return absl::InvalidArgumentError("num_experts: a qwen2 model has none");
    return absl::OkStatus();
  }
  if (m.num_experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts: must be > 0 for ", c.model_type));
  }
  if (m.num_experts_per_tok < 1 || m.num_experts_per_tok > m.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts_per_tok: must be in [1, num_experts = ",
                                                   m.num_experts, "], got ", m.num_experts_per_tok));
  }
  if (m.moe_intermediate_size <= 0) {
    return absl::InvalidArgumentError("moe_intermediate_size: must be > 0");
  }
  if (m.decoder_sparse_step < 1) {
    return absl::InvalidArgumentError("decoder_sparse_step: must be >= 1");
  }
  for (int64_t layer : m.mlp_only_layers) {
    if (layer < 0 || layer >= c.num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("mlp_only_layers: layer ", layer, " not in [0, ",
                                                     c.num_hidden_layers, ")"));
    }
  }
  if (m.shared_expert_intermediate_size < 0) {
    return absl::InvalidArgumentError("shared_expert_intermediate_size: must be >= 0");
  }
  if (c.model_type == "qwen3_moe" && m.shared_expert_intermediate_size != 0) {
    return absl::InvalidArgumentError("shared_expert_intermediate_size: qwen3_moe has no shared expert");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelConfig(const ModelConfig& c) {
  if (c.model_type != "qwen2" && c.model_type != "qwen2_moe" && c.model_type != "qwen3_moe") {
    return absl::InvalidArgumentError(absl::StrCat("model_type: unsupported '", c.model_type, "'"));
  }
  auto positive = [](const char* field, int64_t v) -> absl::Status {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat(field, ": must be > 0, got ", v));
    return absl::OkStatus();
  };
  for (const auto& [field, v] :
       {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
        {"hidden_size", c.hidden_size},
        {"intermediate_size", c.intermediate_size},
        {"num_hidden_layers", c.num_hidden_layers},
        {"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.num_key_value_heads},
        {"max_position_embeddings", c.max_position_embeddings}}) {
    auto s = positive(field, v);
    if (!s.ok()) return s;
  }
  if (c.head_dim_override < 0) return absl::InvalidArgumentError("head_dim: must be > 0");
  if (c.head_dim_override == 0 && c.hidden_size % c.num_attention_heads != 0) {
    return absl::InvalidArgumentError("hidden_size: not divisible by num_attention_heads");
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError("hidden_size: head_dim must be even for RoPE");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        "num_key_value_heads: must divide num_attention_heads");
  }
  if (!(c.rms_norm_eps > 0)) return absl::InvalidArgumentError("rms_norm_eps: must be > 0");
  if (!(c.rope_theta > 0)) return absl::InvalidArgumentError("rope_theta: must be > 0");
  if (c.torch_dtype != "float32" && c.torch_dtype != "float16" && c.torch_dtype != "bfloat16") {
    return absl::InvalidArgumentError(
        absl::StrCat("torch_dtype: unsupported '", c.torch_dtype, "'"));
  }
  return ValidateMoeConfig(c);
}

absl::StatusOr<ModelConfig> ParseModelConfigJson(const std::string& json_text) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  ModelConfig c;
  if (j.contains("model_type")) {
    if (!j["model_type"].is_string()) {
      return absl::InvalidArgumentError("config.json: model_type: not a string");
    }
    c.model_type = j["model_type"].get<std::string>();
  }
  auto get_int = [&](const char* key, int64_t* out, bool required) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) return absl::InvalidArgumentError(absl::StrCat("config.json: missing ", key));
      return absl::OkStatus();
    }
    if (!j[key].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": not an integer"));
    }
    *out = j[key].get<int64_t>();
    return absl::OkStatus();
  };
  for (const auto& [key, out] : {std::pair<const char*, int64_t*>{"vocab_size", &c.vocab_size},
                                 {"hidden_size", &c.hidden_size},
                                 {"intermediate_size", &c.intermediate_size},
                                 {"num_hidden_layers", &c.num_hidden_layers},
                                 {"num_attention_heads", &c.num_attention_heads}}) {
    auto s = get_int(key, out, true);
    if (!s.ok()) return s;
  }
  c.num_key_value_heads = c.num_attention_heads;
  for (const auto& [key, out] :
       {std::pair<const char*, int64_t*>{"num_key_value_heads", &c.num_key_value_heads},
        {"max_position_embeddings", &c.max_position_embeddings},
        {"head_dim", &c.head_dim_override},
        {"num_experts", &c.moe.num_experts},
        {"num_experts_per_tok", &c.moe.num_experts_per_tok},
        {"moe_intermediate_size", &c.moe.moe_intermediate_size},
        {"decoder_sparse_step", &c.moe.decoder_sparse_step},
        {"shared_expert_intermediate_size", &c.moe.shared_expert_intermediate_size}}) {
    auto s = get_int(key, out, false);
    if (!s.ok()) return s;
  }
  if (c.model_type == "qwen2") c.moe = MoeConfig();  // dense configs may carry unused keys
  if (j.contains("norm_topk_prob") && !j["norm_topk_prob"].is_null()) {
    if (!j["norm_topk_prob"].is_boolean()) {
      return absl::InvalidArgumentError("config.json: norm_topk_prob: not a boolean");
    }
    c.moe.norm_topk_prob = j["norm_topk_prob"].get<bool>();
  }
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array()) {
      return absl::InvalidArgumentError("config.json: mlp_only_layers: not a list");
    }
    for (const auto& v : j["mlp_only_layers"]) {
      if (!v.is_number_integer()) {
        return absl::InvalidArgumentError("config.json: mlp_only_layers: not a list of integers");
      }
      c.moe.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  if (j.contains("rms_norm_eps")) c.rms_norm_eps = j["rms_norm_eps"].get<double>();
  if (j.contains("rope_theta")) {
    c.rope_theta = j["rope_theta"].get<double>();
  } else if (j.contains("rope_parameters") && j["rope_parameters"].contains("rope_theta")) {
    c.rope_theta = j["rope_parameters"]["rope_theta"].get<double>();  // transformers >= 5
  }
  if (j.contains("tie_word_embeddings")) c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  const char* dtype_key = j.contains("torch_dtype") ? "torch_dtype" : "dtype";
  if (j.contains(dtype_key) && j[dtype_key].is_string()) {
    c.torch_dtype = j[dtype_key].get<std::string>();
  }
  auto s = ValidateModelConfig(c);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("config.json: ", s.message()));
  return c;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {c.model_type == "qwen2_moe"   ? "Qwen2MoeForCausalLM"
                        : c.model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                                                      : "Qwen2ForCausalLM"};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_hidden_layers;
  j["initializer_range"] = 0.02;
  j["use_cache"] = false;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 1;
  if (c.head_dim_override > 0) j["head_dim"] = c.head_dim_override;
  if (c.is_moe()) {
    j["num_experts"] = c.moe.num_experts;
    j["num_experts_per_tok"] = c.moe.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe.moe_intermediate_size;
    j["norm_topk_prob"] = c.moe.norm_topk_prob;
    j["decoder_sparse_step"] = c.moe.decoder_sparse_step;
    j["mlp_only_layers"] = c.moe.mlp_only_layers;
    j["output_router_logits"] = false;
    j["router_aux_loss_coef"] = 0.0;
    if (c.model_type == "qwen2_moe") {
      j["shared_expert_intermediate_size"] = c.moe.shared_expert_intermediate_size;
      j["qkv_bias"] = true;
    } else {
      j["attention_bias"] = false;
    }
  }
  return j.dump(2) + "\n";
}

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
  } else {
    return absl::InvalidArgumentError(absl::StrCat("preset: unknown model preset '", name, "'"));
  }
  return c;
}

}  // namespace lorastep
