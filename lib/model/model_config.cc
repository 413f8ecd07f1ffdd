#include "lib/model/model_config.h"
#include "lib/model/model_config_families.h"

#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "nlohmann/json.hpp"

namespace lorastep {

int64_t ModelConfig::MatmulParameterCount() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim(),
                kv = num_key_value_heads * head_dim();
  int64_t total = vocab_size * h;  // LM head
  const LinearAttentionConfig& la = linear_attention;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    if (IsLinearAttentionLayer(layer)) {
      total += la.projection_parameters(h);
    } else {
      total += (gated_attention() ? 3 : 2) * h * q /*q (and its gate), o*/ + 2 * h * kv /*k,v*/;
    }
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
  const LinearAttentionConfig& la = linear_attention;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    total += 2 * h /*norms*/;
    if (IsLinearAttentionLayer(layer)) {  // projections, convolution, A_log, dt_bias, gated norm
      total += la.projection_parameters(h) + la.conv_dim() * la.conv_kernel + 2 * la.num_value_heads +
               la.value_head_dim;
    } else {
      total += (gated_attention() ? 3 : 2) * h * q + 2 * h * kv;
      if (qk_norm()) total += 2 * d;  // q/k norms
    }
    if (qkv_bias()) total += q + 2 * kv;  // q/k/v biases
    if (o_bias()) total += h;
    if (attention_sinks()) total += num_attention_heads;
    if (!IsMoeLayer(layer)) {
      total += 3 * h * intermediate_size;
      continue;
    }
    total += moe.num_experts * (h + 3 * h * moe.moe_intermediate_size);  // router + experts
    if (router_bias()) total += moe.num_experts;
    if (expert_bias()) total += moe.num_experts * (2 * moe.moe_intermediate_size + h);
    if (moe.shared_expert_intermediate_size > 0) total += 3 * h * moe.shared_expert_intermediate_size + h;
  }
  return total;
}

int64_t ModelConfig::LinearAttentionWidth(int slot) const {
  switch (slot) {
    case 7: return linear_attention.conv_dim();     // in_proj_qkv
    case 8: case 11: return linear_attention.value_dim();  // in_proj_z; out_proj's input
    default: return linear_attention.num_value_heads;       // in_proj_b, in_proj_a
  }
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
  if (!c.moe_family()) {
    if (m.num_experts != 0) return absl::InvalidArgumentError(absl::StrCat("num_experts: a ", c.model_type, " model has none"));
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
  if (c.gpt_oss()) {
    if (m.shared_expert_intermediate_size != 0 || m.decoder_sparse_step != 1 || !m.mlp_only_layers.empty()) {
      return absl::InvalidArgumentError("num_local_experts: gpt_oss has routed experts on every layer and no shared one");
    }
    if (!(m.swiglu_limit > 0)) return absl::InvalidArgumentError("swiglu_limit: must be > 0");
    if (!(m.swiglu_alpha > 0)) return absl::InvalidArgumentError("swiglu_alpha: must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelConfig(const ModelConfig& c) {
  if (c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "llama" && !c.moe_family() &&
      !c.qwen3_5()) {
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
  const RopeConfig& r = c.rope;
  if (r.type != "default" && !(r.factor >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_scaling.factor: ", r.factor, " must be >= 1 for ", r.type));
  }
  if (r.type == "llama3") {
    if (r.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError("rope_scaling.original_max_position_embeddings: required by llama3 RoPE");
    }
    if (!(r.high_freq_factor > r.low_freq_factor && r.low_freq_factor > 0)) {
      return absl::InvalidArgumentError("rope_scaling.high_freq_factor: must be > low_freq_factor > 0");
    }
  }
  if (r.type == "yarn" && !(r.beta_fast > 0 && r.beta_slow > 0 && r.attention_factor >= 0)) {
    return absl::InvalidArgumentError("rope_scaling.beta_fast: beta_fast, beta_slow must be > 0, attention_factor >= 0");
  }
  if (c.torch_dtype != "float32" && c.torch_dtype != "float16" && c.torch_dtype != "bfloat16") {
    return absl::InvalidArgumentError(
        absl::StrCat("torch_dtype: unsupported '", c.torch_dtype, "'"));
  }
  if (!c.sliding_layers.empty() && static_cast<int64_t>(c.sliding_layers.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer_types: ", c.sliding_layers.size(), " entries for ",
                                                   c.num_hidden_layers, " layers"));
  }
  if (c.HasSlidingLayers() && c.sliding_window < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sliding_window: ", c.sliding_window,
                                                   " must be >= 1 where layers attend in a sliding window"));
  }
  if (c.HasSlidingLayers() && c.model_type == "llama") {
    return absl::InvalidArgumentError("layer_types: llama has no sliding-window layers");
  }
  if (c.qwen3_5()) LORASTEP_RETURN_IF_ERROR(ValidateLinearAttention(c));
  if (!c.quantization.empty() && !(c.quantization == "mxfp4" && c.gpt_oss())) {
    return absl::InvalidArgumentError(absl::StrCat("quantization_config.quant_method: '", c.quantization,
                                                   "' is not built (mxfp4 on gpt_oss experts only)"));
  }
  return ValidateMoeConfig(c);
}

namespace {

// Every key of a config.json is accounted for: read (the shape, RoPE's base, the MoE
// settings), required to hold the value lorastep computes with, or on the list of keys that
// do not change the model's maths (docs/API.md). Anything else is refused by name: a key
// transformers reads is never silently ignored.
absl::Status CheckConfigKeys(const nlohmann::json& j, const std::string& model_type) {
  static const std::set<std::string> kRead = {
      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "max_position_embeddings", "head_dim", "rms_norm_eps", "rope_theta",
      "rope_parameters", "rope_scaling", "tie_word_embeddings", "torch_dtype", "dtype", "hidden_act",
      "attention_dropout", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
      "attention_bias", "mlp_bias", "use_mrope", "pretraining_tp"};
  static const std::set<std::string> kMoeRead = {
      "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
      "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "qkv_bias"};
  // gpt-oss's own keys; Qwen's sliding-window and MoE keys mean nothing to it and are refused.
  static const std::set<std::string> kGptOssRead = {"num_local_experts", "num_experts_per_tok", "swiglu_limit",
                                                    "swiglu_alpha", "quantization_config"};
  static const std::set<std::string> kNotGptOss = {"use_sliding_window", "max_window_layers", "mlp_bias",
                                                   "use_mrope", "pretraining_tp"};
  // Qwen3.5's own keys; Qwen2's sliding-window keys mean nothing to it and are refused.
  static const std::set<std::string> kQwen35Read = {"linear_conv_kernel_dim", "linear_key_head_dim",
                                                    "linear_value_head_dim",  "linear_num_key_heads",
                                                    "linear_num_value_heads", "full_attention_interval",
                                                    "partial_rotary_factor"};
  static const std::set<std::string> kNotQwen35 = {"use_sliding_window", "max_window_layers", "sliding_window",
                                                   "mlp_bias", "use_mrope", "pretraining_tp"};
  // No effect on the log-probs or gradients lorastep computes: bookkeeping, generation
  // defaults, initialization of new weights, token ids, and the MoE auxiliary loss (which
  // transformers adds only to its own language-modelling loss).
  static const std::set<std::string> kNoEffect = {
      "architectures", "transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation",
      "_attn_implementation_autoset", "auto_map", "use_cache", "initializer_range", "bos_token_id",
      "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "return_dict",
      "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
      "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
      "cross_attention_hidden_size", "tie_encoder_decoder", "id2label", "label2id", "num_labels",
      "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "max_length",
      "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
      "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
      "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
      "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
      "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
      "base_model_tp_plan", "base_model_pp_plan", "output_router_logits", "router_aux_loss_coef"};
  const bool moe = model_type == "qwen2_moe" || model_type == "qwen3_moe";
  const bool gpt_oss = model_type == "gpt_oss";
  const bool qwen3_5 = model_type == "qwen3_5_text" || model_type == "qwen3_5_moe_text";
  // Qwen3.5-MoE's experts: a shared expert and its gate always, the top-k renormalized.
  static const std::set<std::string> kQwen35MoeRead = {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                       "shared_expert_intermediate_size"};
  auto refuse = [](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": ", why));
  };
  for (const auto& [key, value] : j.items()) {
    if (kNoEffect.count(key)) continue;
    const bool read = gpt_oss   ? (kRead.count(key) && !kNotGptOss.count(key)) || kGptOssRead.count(key)
                      : qwen3_5 ? (kRead.count(key) && !kNotQwen35.count(key)) || kQwen35Read.count(key) ||
                                      (model_type == "qwen3_5_moe_text" && kQwen35MoeRead.count(key))
                                : kRead.count(key) || (moe && kMoeRead.count(key));
    if (!read) {
      return refuse(key, absl::StrCat("not a key lorastep reads for ", model_type,
                                      "; it may change the model, so the folder is refused rather than the key "
                                      "ignored (docs/API.md lists the keys read and those without effect)"));
    }
  }
  auto is = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  if (is("num_experts") && is("num_local_experts") && j["num_experts"] != j["num_local_experts"]) {
    return refuse("num_local_experts", "differs from num_experts (two names of one setting)");
  }
  if (is("hidden_act") && !(j["hidden_act"] == "silu" || j["hidden_act"] == "swish")) {
    return refuse("hidden_act", absl::StrCat(j["hidden_act"].dump(), " is not supported (the MLP is SwiGLU with SiLU)"));
  }
  if (is("attention_dropout") && !(j["attention_dropout"].is_number() && j["attention_dropout"].get<double>() == 0)) {
    return refuse("attention_dropout", absl::StrCat(j["attention_dropout"].dump(), " is not supported (0 only)"));
  }
  if (model_type == "llama" && is("use_sliding_window") && j["use_sliding_window"] != false) {
    return refuse("use_sliding_window", "llama has no sliding-window attention");
  }
  // RoPE, in either spelling: a variant transformers computes, with only the keys it reads.
  static const std::map<std::string, std::set<std::string>> kRopeKeys = {
      {"default", {}},
      {"linear", {"factor"}},
      {"dynamic", {"factor", "original_max_position_embeddings"}},
      {"yarn", {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"}},
      {"llama3", {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}};
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!is(key)) continue;
    if (!j[key].is_object()) return refuse(key, "not an object");
    const char* type_key = j[key].contains("rope_type") ? "rope_type" : "type";
    const nlohmann::json type = j[key].contains(type_key) ? j[key][type_key] : nlohmann::json("default");
    auto known = type.is_string() ? kRopeKeys.find(type.get<std::string>()) : kRopeKeys.end();
    if (known == kRopeKeys.end()) {
      return refuse(absl::StrCat(key, ".", type_key),
                    absl::StrCat(type.dump(), " RoPE is not built (default, linear, dynamic, yarn, llama3)"));
    }
    for (const auto& [name, v] : j[key].items()) {
      if (name == "rope_theta" || name == "rope_type" || name == "type" || v.is_null()) continue;
      // Qwen3.5: the rotated share of each head; multimodal RoPE's sections, which give text
      // tokens (one position for all three axes) plain RoPE.
      if (qwen3_5 && (name == "mrope_section" || name == "mrope_interleaved")) continue;
      if (qwen3_5 && name == "partial_rotary_factor") {
        if (!v.is_number()) return refuse(absl::StrCat(key, ".", name), "not a number");
        continue;
      }
      if (!known->second.count(name)) {
        return refuse(absl::StrCat(key, ".", name), absl::StrCat("not read by ", known->first, " RoPE"));
      }
      if (name == "truncate" ? !v.is_boolean() : !v.is_number()) {
        return refuse(absl::StrCat(key, ".", name), name == "truncate" ? "not a boolean" : "not a number");
      }
    }
  }
  // Qwen2's attention has q/k/v biases; Qwen3's and Llama's none (their attention_bias also
  // puts one on o_proj: not built); gpt-oss's q/k/v and o biases are its attention_bias.
  const bool qkv_bias = model_type == "qwen2" || model_type == "qwen2_moe" || gpt_oss;
  if (is("quantization_config")) {
    const nlohmann::json& q = j["quantization_config"];
    if (!q.is_object() || !q.contains("quant_method") || q["quant_method"] != "mxfp4") {
      return refuse("quantization_config.quant_method",
                    absl::StrCat(q.is_object() && q.contains("quant_method") ? q["quant_method"].dump() : "(none)",
                                 " is not built (mxfp4 experts are dequantized at load)"));
    }
    for (const auto& [name, v] : q.items()) {
      if (name != "quant_method" && name != "modules_to_not_convert") {
        return refuse(absl::StrCat("quantization_config.", name), "not read by the mxfp4 loader");
      }
    }
  }
  for (const char* key : {"swiglu_limit", "swiglu_alpha"}) {
    if (is(key) && !j[key].is_number()) return refuse(key, "not a number");
  }
  if (is("pretraining_tp") && j["pretraining_tp"] != 1) return refuse("pretraining_tp", "only 1 (the exact matmuls)");
  if (is("attention_bias") && j["attention_bias"] != qkv_bias) {
    return refuse("attention_bias", absl::StrCat(j["attention_bias"].dump(), " is not ", model_type, "'s attention"));
  }
  if (is("qkv_bias") && j["qkv_bias"] != qkv_bias) {
    return refuse("qkv_bias", absl::StrCat(j["qkv_bias"].dump(), " is not ", model_type, "'s attention"));
  }
  if (is("mlp_bias") && j["mlp_bias"] != false) return refuse("mlp_bias", "MLP biases are not built");
  if (is("use_mrope") && j["use_mrope"] != false) return refuse("use_mrope", "multimodal RoPE is not built");
  return absl::OkStatus();
}

// Which layers attend in a sliding window, as transformers' Qwen2 / Qwen3 configs decide:
// `layer_types` when given; else, with use_sliding_window, the layers from max_window_layers
// on (sliding_window and max_window_layers default to 4096 and 28 there). Without
// use_sliding_window transformers drops sliding_window, so a sliding layer then has none.
// gpt-oss: the window always applies (sliding_window, default 128) and layer_types defaults
// to sliding layers at even indices.
absl::Status ReadSlidingWindow(const nlohmann::json& j, ModelConfig* c) {
  auto bad = [](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ": ", why));
  };
  auto present = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  if (present("use_sliding_window") && !j["use_sliding_window"].is_boolean()) {
    return bad("use_sliding_window", "not a boolean");
  }
  const bool use = c->gpt_oss() || (present("use_sliding_window") && j["use_sliding_window"].get<bool>());
  int64_t window = 0;
  if (use) {
    window = c->gpt_oss() ? 128 : 4096;
    if (present("sliding_window")) {
      if (!j["sliding_window"].is_number_integer()) return bad("sliding_window", "not an integer");
      window = j["sliding_window"].get<int64_t>();
    }
  }
  std::vector<bool> sliding;
  if (present("layer_types")) {
    if (!j["layer_types"].is_array()) return bad("layer_types", "not a list");
    for (const auto& t : j["layer_types"]) {
      if (t == "sliding_attention") {
        sliding.push_back(true);
      } else if (t == "full_attention") {
        sliding.push_back(false);
      } else {
        return bad("layer_types", absl::StrCat(t.dump(), " is not sliding_attention or full_attention"));
      }
    }
  } else if (c->gpt_oss()) {
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) sliding.push_back(i % 2 == 0);
  } else if (use) {
    int64_t first = 28;
    if (present("max_window_layers")) {
      if (!j["max_window_layers"].is_number_integer()) return bad("max_window_layers", "not an integer");
      first = j["max_window_layers"].get<int64_t>();
    }
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) sliding.push_back(i >= first);
  }
  // gpt-oss with `sliding_window: null`: transformers gives its sliding layers no window.
  if (c->gpt_oss() && j.contains("sliding_window") && j["sliding_window"].is_null()) sliding.clear();
  if (present("layer_types") && static_cast<int64_t>(sliding.size()) != c->num_hidden_layers) {
    return bad("layer_types", absl::StrCat(sliding.size(), " entries for ", c->num_hidden_layers, " layers"));
  }
  c->sliding_layers = std::move(sliding);
  c->sliding_window = window;
  if (c->HasSlidingLayers() && !use) {
    return bad("layer_types", "sliding_attention layers without use_sliding_window (transformers then has no window)");
  }
  if (!c->HasSlidingLayers()) {  // all full: nothing to keep
    c->sliding_layers.clear();
    c->sliding_window = 0;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfigJson(const std::string& json_text) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  if (j.contains("model_type") && (j["model_type"] == "qwen3_5" || j["model_type"] == "qwen3_5_moe")) {
    LORASTEP_ASSIGN_OR_RETURN(nlohmann::json text, TextConfigOfVl(j));
    LORASTEP_ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfigJson(text.dump()));
    c.language_model_of_vl = true;
    return c;
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
    // Qwen3.5-MoE has no dense MLP, hence no intermediate_size (it takes the experts' width).
    auto s = get_int(key, out, !(c.model_type == "qwen3_5_moe_text" && std::string(key) == "intermediate_size"));
    if (!s.ok()) return s;
  }
  c.num_key_value_heads = c.num_attention_heads;
  for (const auto& [key, out] :
       {std::pair<const char*, int64_t*>{"num_key_value_heads", &c.num_key_value_heads},
        {"max_position_embeddings", &c.max_position_embeddings},
        {"head_dim", &c.head_dim_override},
        {"num_experts", &c.moe.num_experts},
        {"num_local_experts", &c.moe.num_experts},  // transformers 5's name of num_experts
        {"num_experts_per_tok", &c.moe.num_experts_per_tok},
        {"moe_intermediate_size", &c.moe.moe_intermediate_size},
        {"decoder_sparse_step", &c.moe.decoder_sparse_step},
        {"shared_expert_intermediate_size", &c.moe.shared_expert_intermediate_size}}) {
    auto s = get_int(key, out, false);
    if (!s.ok()) return s;
  }
  if (!c.moe_family()) c.moe = MoeConfig();  // (a dense config's expert keys are refused by name below)
  if (c.model_type == "qwen3_5_moe_text") {
    c.moe.norm_topk_prob = true;
    if (c.intermediate_size == 0) c.intermediate_size = c.moe.moe_intermediate_size;
  }
  if (c.gpt_oss()) {  // GptOssConfig's defaults, and its MoE in Qwen-MoE terms
    c.moe.moe_intermediate_size = c.intermediate_size;
    c.moe.norm_topk_prob = true;  // softmax over the top-k router logits
    if (c.moe.num_experts_per_tok == 0) c.moe.num_experts_per_tok = 4;
    if (c.head_dim_override == 0) c.head_dim_override = 64;
    c.tie_word_embeddings = false;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 150000;
    c.rope.type = "yarn", c.rope.factor = 32, c.rope.beta_fast = 32, c.rope.beta_slow = 1, c.rope.truncate = false;
    c.rope.original_max_position_embeddings = 4096;
    c.max_position_embeddings = j.contains("max_position_embeddings") ? c.max_position_embeddings : 131072;
    for (const auto& [key, out] : {std::pair<const char*, double*>{"swiglu_limit", &c.moe.swiglu_limit},
                                   {"swiglu_alpha", &c.moe.swiglu_alpha}}) {
      if (j.contains(key) && j[key].is_number()) *out = j[key].get<double>();
    }
    if (j.contains("quantization_config") && j["quantization_config"].is_object() &&
        j["quantization_config"].contains("quant_method") && j["quantization_config"]["quant_method"].is_string()) {
      c.quantization = j["quantization_config"]["quant_method"].get<std::string>();
    }
  }
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
  for (const char* key : {"rope_parameters", "rope_scaling"}) {  // transformers 5's spelling first
    if (!j.contains(key) || !j[key].is_object()) continue;
    const nlohmann::json& r = j[key];
    if (c.gpt_oss()) c.rope = RopeConfig();  // given: its own keys only
    auto number = [&](const char* name, double* out) {
      if (r.contains(name) && r[name].is_number()) *out = r[name].get<double>();
    };
    if (r.contains("rope_type") && r["rope_type"].is_string()) {
      c.rope.type = r["rope_type"].get<std::string>();
    } else if (r.contains("type") && r["type"].is_string()) {
      c.rope.type = r["type"].get<std::string>();
    }
    number("factor", &c.rope.factor);
    double original = 0;
    number("original_max_position_embeddings", &original);
    c.rope.original_max_position_embeddings = static_cast<int64_t>(original);
    number("low_freq_factor", &c.rope.low_freq_factor);
    number("high_freq_factor", &c.rope.high_freq_factor);
    number("beta_fast", &c.rope.beta_fast);
    number("beta_slow", &c.rope.beta_slow);
    number("attention_factor", &c.rope.attention_factor);
    if (r.contains("truncate") && r["truncate"].is_boolean()) c.rope.truncate = r["truncate"].get<bool>();
    break;
  }
  if (j.contains("tie_word_embeddings")) c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  const char* dtype_key = j.contains("torch_dtype") ? "torch_dtype" : "dtype";
  if (j.contains(dtype_key) && j[dtype_key].is_string()) {
    c.torch_dtype = j[dtype_key].get<std::string>();
  }
  if (c.qwen3_5()) {
    LORASTEP_RETURN_IF_ERROR(ReadQwen35(j, &c));
  } else {
    LORASTEP_RETURN_IF_ERROR(ReadSlidingWindow(j, &c));
  }
  auto s = ValidateModelConfig(c);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("config.json: ", s.message()));
  LORASTEP_RETURN_IF_ERROR(CheckConfigKeys(j, c.model_type));
  return c;
}


std::string ModelConfigToJson(const ModelConfig& c) {
  if (c.gpt_oss()) return GptOssConfigToJson(c);
  if (c.qwen3_5()) return Qwen35ConfigToJson(c);
  nlohmann::ordered_json j = ShapeKeys(c, c.model_type == "qwen2_moe"   ? "Qwen2MoeForCausalLM"
                                         : c.model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                                         : c.model_type == "qwen3"     ? "Qwen3ForCausalLM"
                                         : c.model_type == "llama"     ? "LlamaForCausalLM"
                                                                       : "Qwen2ForCausalLM");
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = c.HasSlidingLayers();
  j["sliding_window"] = c.HasSlidingLayers() ? nlohmann::ordered_json(c.sliding_window) : nlohmann::ordered_json();
  j["max_window_layers"] = c.num_hidden_layers;
  if (c.HasSlidingLayers()) {
    nlohmann::ordered_json types = nlohmann::ordered_json::array();
    for (bool s : c.sliding_layers) types.push_back(s ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  j["initializer_range"] = 0.02;
  j["use_cache"] = false;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 1;
  if (c.head_dim_override > 0) j["head_dim"] = c.head_dim_override;
  if (c.model_type == "qwen3" || c.model_type == "llama") j["attention_bias"] = false;
  if (c.model_type == "llama") j["mlp_bias"] = false;
  if (c.rope.type != "default") {  // as older Hub configs spell it (transformers 5 reads it too)
    nlohmann::ordered_json r;
    r["rope_type"] = c.rope.type;
    r["factor"] = c.rope.factor;
    if (c.rope.original_max_position_embeddings > 0) {
      r["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
    }
    if (c.rope.type == "llama3") {
      r["low_freq_factor"] = c.rope.low_freq_factor;
      r["high_freq_factor"] = c.rope.high_freq_factor;
    }
    if (c.rope.type == "yarn") {
      r["beta_fast"] = c.rope.beta_fast;
      r["beta_slow"] = c.rope.beta_slow;
      if (c.rope.attention_factor > 0) r["attention_factor"] = c.rope.attention_factor;
    }
    j["rope_scaling"] = r;
  }
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

}  // namespace lorastep
