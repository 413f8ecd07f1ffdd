#include "lib/model/model_config.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace lorastep {

int64_t ModelConfig::MatmulParameterCount() const {
  const int64_t h = hidden_size, kv = num_key_value_heads * head_dim();
  const int64_t per_layer = h * h /*q*/ + 2 * h * kv /*k,v*/ + h * h /*o*/ +
                            3 * h * intermediate_size /*gate,up,down*/;
  return num_hidden_layers * per_layer + vocab_size * h /*LM head*/;
}

int64_t ModelConfig::TotalParameterCount() const {
  const int64_t h = hidden_size, kv = num_key_value_heads * head_dim();
  const int64_t per_layer_extra = h + 2 * kv /*q,k,v bias*/ + 2 * h /*norms*/;
  int64_t total = MatmulParameterCount() + num_hidden_layers * per_layer_extra + h;
  if (!tie_word_embeddings) total += vocab_size * h;
  return total;
}

absl::Status ValidateModelConfig(const ModelConfig& c) {
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
  if (c.hidden_size % c.num_attention_heads != 0) {
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
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseModelConfigJson(const std::string& json_text) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  if (j.contains("model_type") && j["model_type"] != "qwen2") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: model_type: unsupported '", j["model_type"].dump(), "'"));
  }
  ModelConfig c;
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
        {"max_position_embeddings", &c.max_position_embeddings}}) {
    auto s = get_int(key, out, false);
    if (!s.ok()) return s;
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
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
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
  } else {
    return absl::InvalidArgumentError(absl::StrCat("preset: unknown model preset '", name, "'"));
  }
  return c;
}

}  // namespace lorastep
