#include "lib/model/model_config_families.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

absl::StatusOr<nlohmann::json> TextConfigOfVl(const nlohmann::json& j) {
  static const std::set<std::string> kWrapper = {
      "model_type", "text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
      "vision_end_token_id", "tie_word_embeddings", "torch_dtype", "dtype", "architectures", "transformers_version",
      "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache"};
  for (const auto& [key, value] : j.items()) {
    if (!kWrapper.count(key)) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": not a key of the ",
                                                     j["model_type"].get<std::string>(), " wrapper lorastep reads"));
    }
  }
  if (!j.contains("text_config") || !j["text_config"].is_object()) {
    return absl::InvalidArgumentError("config.json: text_config: missing (the vision-language folder's text model)");
  }
  nlohmann::json text = j["text_config"];
  const bool moe = j["model_type"] == "qwen3_5_moe";
  if (!text.contains("model_type")) text["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
  if (text["model_type"] != (moe ? "qwen3_5_moe_text" : "qwen3_5_text")) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: text_config.model_type: ", text["model_type"].dump(),
                                                   " is not ", moe ? "qwen3_5_moe_text" : "qwen3_5_text"));
  }
  for (const char* key : {"tie_word_embeddings", "torch_dtype", "dtype"}) {
    if (j.contains(key) && !text.contains(key)) text[key] = j[key];
  }
  return text;
}

nlohmann::ordered_json ShapeKeys(const ModelConfig& c, const char* architecture) {
  nlohmann::ordered_json j;
  j["architectures"] = {architecture};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  return j;
}

// Qwen3.5's hybrid layers: Gated DeltaNet sizes, the layer pattern, partial RoPE.
absl::Status ValidateLinearAttention(const ModelConfig& c) {
  const LinearAttentionConfig& l = c.linear_attention;
  for (const auto& [field, v] : {std::pair<const char*, int64_t>{"linear_conv_kernel_dim", l.conv_kernel},
                                 {"linear_key_head_dim", l.key_head_dim},
                                 {"linear_value_head_dim", l.value_head_dim},
                                 {"linear_num_key_heads", l.num_key_heads},
                                 {"linear_num_value_heads", l.num_value_heads}}) {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat(field, ": must be > 0, got ", v));
  }
  if (l.num_value_heads % l.num_key_heads != 0) {
    return absl::InvalidArgumentError("linear_num_value_heads: must be a multiple of linear_num_key_heads");
  }
  if (static_cast<int64_t>(c.linear_layers.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer_types: ", c.linear_layers.size(), " entries for ",
                                                   c.num_hidden_layers, " layers"));
  }
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) || c.rotary_dim() % 2 != 0 ||
      c.rotary_dim() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("partial_rotary_factor: ", c.partial_rotary_factor,
                                                   " must give an even, nonzero share of head_dim ", c.head_dim()));
  }
  return absl::OkStatus();
}


// Qwen3.5's settings as Qwen3_5TextConfig reads them: the Gated DeltaNet sizes (defaults 4,
// 128, 128, 16, 32), `layer_types` (linear_attention / full_attention) or every
// `full_attention_interval`-th layer (4) full, partial_rotary_factor (0.25; at the top or in
// the RoPE settings), head_dim (256).
absl::Status ReadQwen35(const nlohmann::json& j, ModelConfig* c) {
  auto bad = [](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": ", why));
  };
  auto present = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  LinearAttentionConfig& l = c->linear_attention;
  for (const auto& [key, out] : {std::pair<const char*, int64_t*>{"linear_conv_kernel_dim", &l.conv_kernel},
                                 {"linear_key_head_dim", &l.key_head_dim},
                                 {"linear_value_head_dim", &l.value_head_dim},
                                 {"linear_num_key_heads", &l.num_key_heads},
                                 {"linear_num_value_heads", &l.num_value_heads}}) {
    if (!present(key)) continue;
    if (!j[key].is_number_integer()) return bad(key, "not an integer");
    *out = j[key].get<int64_t>();
  }
  if (!present("head_dim")) c->head_dim_override = 256;
  if (!present("tie_word_embeddings")) c->tie_word_embeddings = false;
  c->partial_rotary_factor = 0.25;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (present(key) && j[key].is_object() && j[key].contains("partial_rotary_factor") &&
        j[key]["partial_rotary_factor"].is_number()) {
      c->partial_rotary_factor = j[key]["partial_rotary_factor"].get<double>();
    }
  }
  if (present("partial_rotary_factor")) {
    if (!j["partial_rotary_factor"].is_number()) return bad("partial_rotary_factor", "not a number");
    c->partial_rotary_factor = j["partial_rotary_factor"].get<double>();
  }
  c->linear_layers.clear();
  if (present("layer_types")) {
    if (!j["layer_types"].is_array()) return bad("layer_types", "not a list");
    for (const auto& t : j["layer_types"]) {
      if (t != "linear_attention" && t != "full_attention") {
        return bad("layer_types", absl::StrCat(t.dump(), " is not linear_attention or full_attention"));
      }
      c->linear_layers.push_back(t == "linear_attention");
    }
  } else {
    int64_t interval = 4;
    if (present("full_attention_interval")) {
      if (!j["full_attention_interval"].is_number_integer() || j["full_attention_interval"].get<int64_t>() < 1) {
        return bad("full_attention_interval", "not an integer >= 1");
      }
      interval = j["full_attention_interval"].get<int64_t>();
    }
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) c->linear_layers.push_back((i + 1) % interval != 0);
  }
  return absl::OkStatus();
}



// gpt-oss's config.json, with the keys GptOssConfig has.
std::string GptOssConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j = ShapeKeys(c, "GptOssForCausalLM");
  j["intermediate_size"] = c.moe.moe_intermediate_size;
  j["head_dim"] = c.head_dim();
  j["num_local_experts"] = c.moe.num_experts;
  j["num_experts_per_tok"] = c.moe.num_experts_per_tok;
  j["swiglu_limit"] = c.moe.swiglu_limit;
  j["swiglu_alpha"] = c.moe.swiglu_alpha;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  nlohmann::ordered_json r;
  r["rope_type"] = c.rope.type;
  if (c.rope.type != "default") r["factor"] = c.rope.factor;
  if (c.rope.type == "yarn") {
    r["beta_fast"] = c.rope.beta_fast;
    r["beta_slow"] = c.rope.beta_slow;
    r["truncate"] = c.rope.truncate;
    if (c.rope.attention_factor > 0) r["attention_factor"] = c.rope.attention_factor;
  }
  if (c.rope.original_max_position_embeddings > 0) {
    r["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
  }
  j["rope_scaling"] = r;
  j["sliding_window"] = c.HasSlidingLayers() ? nlohmann::ordered_json(c.sliding_window) : nlohmann::ordered_json();
  nlohmann::ordered_json types = nlohmann::ordered_json::array();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    types.push_back(c.AttentionWindow(i) > 0 ? "sliding_attention" : "full_attention");
  }
  j["layer_types"] = types;
  j["attention_bias"] = true;
  j["attention_dropout"] = 0.0;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = c.torch_dtype;
  j["router_aux_loss_coef"] = 0.0;
  j["output_router_logits"] = false;
  j["initializer_range"] = 0.02;
  j["use_cache"] = false;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 1;
  return j.dump(2) + "\n";
}

// Qwen3.5's config.json (Qwen3_5TextConfig's keys).
std::string Qwen35ConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j = ShapeKeys(c, c.is_moe() ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM");
  if (c.is_moe()) {  // no dense MLP: the experts' keys instead of intermediate_size
    j.erase("intermediate_size");
    j["num_experts"] = c.moe.num_experts;
    j["num_experts_per_tok"] = c.moe.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe.moe_intermediate_size;
    j["shared_expert_intermediate_size"] = c.moe.shared_expert_intermediate_size;
    j["router_aux_loss_coef"] = 0.0;
  }
  j["head_dim"] = c.head_dim();
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta},
                          {"partial_rotary_factor", c.partial_rotary_factor}};
  j["linear_conv_kernel_dim"] = c.linear_attention.conv_kernel;
  j["linear_key_head_dim"] = c.linear_attention.key_head_dim;
  j["linear_value_head_dim"] = c.linear_attention.value_head_dim;
  j["linear_num_key_heads"] = c.linear_attention.num_key_heads;
  j["linear_num_value_heads"] = c.linear_attention.num_value_heads;
  nlohmann::ordered_json types = nlohmann::ordered_json::array();
  for (bool linear : c.linear_layers) types.push_back(linear ? "linear_attention" : "full_attention");
  j["layer_types"] = types;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  j["initializer_range"] = 0.02;
  j["use_cache"] = false;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 1;
  return j.dump(2) + "\n";
}

}  // namespace lorastep
