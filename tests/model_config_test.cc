// config.json parsing for dense Qwen2 and the MoE families (Qwen2-MoE, Qwen3-MoE), as
// transformers writes them; validation errors name the field.
#include "lib/model/model_config.h"

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;

// Keys as transformers 5's Qwen2MoeConfig.to_json_string() writes them (trimmed).
constexpr char kQwen2Moe[] = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
  "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
  "shared_expert_intermediate_size": 5632, "norm_topk_prob": false,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": false
})";

constexpr char kQwen3Moe[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
  "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "tie_word_embeddings": false, "dtype": "bfloat16",
  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
  "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [0, 47],
  "attention_bias": false
})";

TEST(ModelConfigTest, Qwen2MoeAsTransformersWritesIt) {
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfigJson(kQwen2Moe));
  EXPECT_EQ(c.model_type, "qwen2_moe");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.moe.num_experts, 60);
  EXPECT_EQ(c.moe.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe.moe_intermediate_size, 1408);
  EXPECT_EQ(c.moe.shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.head_dim(), 128);
  for (int64_t layer = 0; layer < 24; ++layer) EXPECT_TRUE(c.IsMoeLayer(layer));
}

TEST(ModelConfigTest, Qwen3MoeWithExplicitHeadDimAndDenseLayers) {
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfigJson(kQwen3Moe));
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.head_dim(), 128);  // given, though 2048 / 32 = 64
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 1000000.0);
  EXPECT_FALSE(c.IsMoeLayer(0));   // mlp_only_layers
  EXPECT_TRUE(c.IsMoeLayer(1));
  EXPECT_FALSE(c.IsMoeLayer(47));
}

TEST(ModelConfigTest, DecoderSparseStep) {
  ModelConfig c = ModelConfigPreset("tiny-moe").value();
  c.num_hidden_layers = 6;
  c.moe.decoder_sparse_step = 2;  // transformers: MoE where (i + 1) % step == 0
  std::vector<bool> moe;
  for (int64_t i = 0; i < 6; ++i) moe.push_back(c.IsMoeLayer(i));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, true, false, true}));
  EXPECT_FALSE(ModelConfigPreset("tiny").value().IsMoeLayer(1));
}

TEST(ModelConfigTest, PresetsRoundTripThroughJson) {
  for (const char* name : {"tiny", "qwen2.5-0.5b", "tiny-moe", "qwen3-30b-a3b-reduced", "tiny-qwen2-swa", "tiny-gpt-oss",
                           "gpt-oss-20b-reduced", "tiny-qwen3.5", "tiny-qwen3.5-moe", "qwen3.5-9b"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelConfigPreset(name));
    ASSERT_OK_AND_ASSIGN(ModelConfig back, ParseModelConfigJson(ModelConfigToJson(c)));
    EXPECT_EQ(back.model_type, c.model_type) << name;
    EXPECT_EQ(back.head_dim(), c.head_dim()) << name;
    EXPECT_EQ(back.moe.num_experts, c.moe.num_experts) << name;
    EXPECT_EQ(back.moe.num_experts_per_tok, c.moe.num_experts_per_tok) << name;
    EXPECT_EQ(back.moe.moe_intermediate_size, c.moe.moe_intermediate_size) << name;
    EXPECT_EQ(back.moe.shared_expert_intermediate_size, c.moe.shared_expert_intermediate_size) << name;
    EXPECT_EQ(back.moe.norm_topk_prob, c.moe.norm_topk_prob) << name;
    EXPECT_EQ(back.sliding_layers, c.sliding_layers) << name;
    EXPECT_EQ(back.sliding_window, c.sliding_window) << name;
    EXPECT_EQ(back.linear_layers, c.linear_layers) << name;
    EXPECT_EQ(back.rotary_dim(), c.rotary_dim()) << name;
    EXPECT_EQ(back.TotalParameterCount(), c.TotalParameterCount()) << name;
  }
  ASSERT_OK_AND_ASSIGN(ModelConfig q3, ModelConfigPreset("qwen3-30b-a3b-reduced"));
  EXPECT_EQ(q3.hidden_size, 2048);
  EXPECT_EQ(q3.moe.num_experts, 128);
  EXPECT_EQ(q3.moe.num_experts_per_tok, 8);
}

TEST(ModelConfigTest, BadMoeValuesNameTheField) {
  auto with = [](const std::string& key, const std::string& value) {
    std::string text = kQwen3Moe;
    const size_t at = text.find("\"" + key + "\"");
    const size_t colon = text.find(':', at);
    const size_t start = text.find_first_not_of(' ', colon + 1);
    const size_t end = text[start] == '[' ? text.find(']', start) + 1 : text.find_first_of(",}", colon);
    return ParseModelConfigJson(text.substr(0, colon + 1) + " " + value + text.substr(end));
  };
  EXPECT_THAT(with("num_experts_per_tok", "200"),
              StatusIs(absl::StatusCode::kInvalidArgument, "num_experts_per_tok: must be in [1, num_experts = 128]"));
  EXPECT_THAT(with("num_experts", "0"), StatusIs(absl::StatusCode::kInvalidArgument, "num_experts: must be > 0"));
  EXPECT_THAT(with("moe_intermediate_size", "0"),
              StatusIs(absl::StatusCode::kInvalidArgument, "moe_intermediate_size"));
  EXPECT_THAT(with("decoder_sparse_step", "0"),
              StatusIs(absl::StatusCode::kInvalidArgument, "decoder_sparse_step"));
  EXPECT_THAT(with("mlp_only_layers", "[48]"),
              StatusIs(absl::StatusCode::kInvalidArgument, "mlp_only_layers: layer 48"));
  EXPECT_THAT(with("mlp_only_layers", "3"), StatusIs(absl::StatusCode::kInvalidArgument, "mlp_only_layers: not a list"));
  EXPECT_THAT(with("norm_topk_prob", "1"), StatusIs(absl::StatusCode::kInvalidArgument, "norm_topk_prob: not a boolean"));
  EXPECT_THAT(with("model_type", "\"gemma\""), StatusIs(absl::StatusCode::kInvalidArgument, "model_type: unsupported"));
  EXPECT_THAT(with("model_type", "7"), StatusIs(absl::StatusCode::kInvalidArgument, "model_type: not a string"));
  EXPECT_THAT(with("head_dim", "-1"), StatusIs(absl::StatusCode::kInvalidArgument, "head_dim"));
  std::string shared = kQwen2Moe;
  shared.replace(shared.find("qwen2_moe"), 9, "qwen3_moe");
  EXPECT_THAT(ParseModelConfigJson(shared),
              StatusIs(absl::StatusCode::kInvalidArgument, "shared_expert_intermediate_size: qwen3_moe has no shared expert"));
}

// Qwen2.5-0.5B's config.json as the Hub has it (transformers 4.x keys).
constexpr char kQwen25[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936
})";

// kQwen25 with `key` set to `value` (a JSON text), added when absent.
absl::StatusOr<ModelConfig> Qwen25With(const std::string& key, const std::string& value) {
  std::string text = kQwen25;
  const size_t at = text.find("\"" + key + "\":");
  if (at == std::string::npos) {
    text.insert(text.rfind('}'), ", \"" + key + "\": " + value);
  } else {
    const size_t start = text.find(':', at) + 1;
    const size_t end = text.find_first_of(",}", start);
    text = text.substr(0, start) + " " + value + text.substr(end);
  }
  return ParseModelConfigJson(text);
}

// A layer_types list of `n` entries of `type`, as JSON.
std::string LayerTypes(int n, const std::string& type) {
  std::string out = "[";
  for (int i = 0; i < n; ++i) out += (i > 0 ? ", \"" : "\"") + type + "\"";
  return out + "]";
}

TEST(ModelConfigTest, EveryKeyOfAHubConfigIsAccountedFor) {
  ASSERT_OK(ParseModelConfigJson(kQwen25).status());
  // Keys without effect on the maths, and keys at the value lorastep computes with.
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"output_router_logits", "true"},
                                                        {"pad_token_id", "null"},
                                                        {"rope_scaling", "null"},
                                                        {"rope_scaling", R"({"type": "default"})"},
                                                        {"rope_parameters", R"({"rope_type": "default", "rope_theta": 1e6})"},
                                                        {"layer_types", LayerTypes(24, "full_attention")},
                                                        {"hidden_act", "\"swish\""},
                                                        {"mlp_bias", "false"},
                                                        {"use_sliding_window", "null"}}) {
    const absl::Status loaded = Qwen25With(key, value).status();
    EXPECT_TRUE(loaded.ok()) << key << " = " << value << ": " << loaded;
  }
}

// Sliding-window layers as transformers' Qwen2Config decides them: with use_sliding_window,
// the layers from max_window_layers on, in a window of sliding_window; layer_types when given.
TEST(ModelConfigTest, SlidingWindowLayersAsTransformersReadsThem) {
  auto set = [](std::string text, const std::string& from, const std::string& to) {
    return text.replace(text.find(from), from.size(), to);
  };
  std::string text = set(kQwen25, "\"use_sliding_window\": false", "\"use_sliding_window\": true");
  text = set(text, "\"max_window_layers\": 24", "\"max_window_layers\": 20");
  text = set(text, "\"sliding_window\": 32768", "\"sliding_window\": 4096");
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfigJson(text));
  EXPECT_EQ(c.sliding_window, 4096);
  for (int64_t l = 0; l < 24; ++l) EXPECT_EQ(c.AttentionWindow(l), l >= 20 ? 4096 : 0) << l;
  // The Hub's Qwen2.5 (use_sliding_window false): no window anywhere, sliding_window ignored.
  ASSERT_OK_AND_ASSIGN(ModelConfig hub, ParseModelConfigJson(kQwen25));
  EXPECT_FALSE(hub.HasSlidingLayers());
  // layer_types over max_window_layers; written back as transformers reads it.
  std::string typed = text;
  std::string types = "[";
  for (int l = 0; l < 24; ++l) types += std::string(l > 0 ? ", " : "") + (l % 2 ? "\"sliding_attention\"" : "\"full_attention\"");
  typed.insert(typed.rfind('}'), ", \"layer_types\": " + types + "]");
  ASSERT_OK_AND_ASSIGN(ModelConfig alternating, ParseModelConfigJson(typed));
  for (int64_t l = 0; l < 24; ++l) EXPECT_EQ(alternating.AttentionWindow(l), l % 2 ? 4096 : 0) << l;
  ASSERT_OK_AND_ASSIGN(ModelConfig back, ParseModelConfigJson(ModelConfigToJson(alternating)));
  EXPECT_EQ(back.sliding_layers, alternating.sliding_layers);
  EXPECT_EQ(back.sliding_window, 4096);
  // A window that cannot be, and a list of the wrong length, are refused by name.
  const std::string zero = set(text, "\"sliding_window\": 4096", "\"sliding_window\": 0");
  EXPECT_THAT(ParseModelConfigJson(zero), StatusIs(absl::StatusCode::kInvalidArgument, "sliding_window: 0 must be >= 1"));
  typed.insert(typed.rfind(']'), ", \"sliding_attention\"");
  EXPECT_THAT(ParseModelConfigJson(typed), StatusIs(absl::StatusCode::kInvalidArgument, "layer_types: 25 entries for 24"));
}

// A key that changes the model and is not built is refused at load, naming it; so is a key
// lorastep does not know (it might change the model).
TEST(ModelConfigTest, KeysThatChangeTheModelAreRefusedByName) {
  const std::vector<std::tuple<std::string, std::string, std::string>> refused = {
      {"hidden_act", "\"gelu\"", "hidden_act: \"gelu\" is not supported"},
      {"attention_dropout", "0.1", "attention_dropout: 0.1 is not supported"},
      {"layer_types", R"(["chunked_attention"])", "layer_types: \"chunked_attention\" is not sliding_attention"},
      {"layer_types", LayerTypes(24, "sliding_attention"), "layer_types: sliding_attention layers without use_sliding_window"},
      {"layer_types", R"(["full_attention"])", "layer_types: 1 entries for 24 layers"},
      {"rope_scaling", R"({"type": "longrope", "factor": 4.0})", "rope_scaling.type: \"longrope\" RoPE is not built"},
      {"rope_scaling", R"({"rope_type": "linear", "factor": 4.0, "beta_fast": 8})",
       "rope_scaling.beta_fast: not read by linear RoPE"},
      {"rope_scaling", R"({"rope_type": "yarn", "factor": 4.0, "mscale": 0.7})", "rope_scaling.mscale: not read by yarn"},
      {"rope_scaling", R"({"rope_type": "linear", "factor": 0.5})", "rope_scaling.factor: 0.5 must be >= 1"},
      {"rope_scaling", R"({"rope_type": "yarn", "factor": "4"})", "rope_scaling.factor: not a number"},
      {"rope_parameters", R"({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8})",
       "original_max_position_embeddings: required by llama3 RoPE"},
      {"rope_parameters", R"({"rope_theta": 1e6, "partial_rotary_factor": 0.5})",
       "rope_parameters.partial_rotary_factor: not read by default RoPE"},
      {"pretraining_tp", "2", "pretraining_tp: only 1"},
      {"rope_scaling", "4", "rope_scaling: not an object"},
      {"mlp_bias", "true", "mlp_bias: MLP biases are not built"},
      {"attention_bias", "false", "attention_bias: false is not qwen2's attention"},
      {"use_mrope", "true", "use_mrope: multimodal RoPE is not built"},
      {"quantization_config", R"({"quant_method": "gptq"})", "quantization_config: not a key lorastep reads for qwen2"},
      {"final_logit_softcapping", "30.0", "final_logit_softcapping: not a key lorastep reads"},
      {"num_experts", "8", "num_experts: not a key lorastep reads for qwen2"},
  };
  for (const auto& [key, value, want] : refused) {
    EXPECT_THAT(Qwen25With(key, value), StatusIs(absl::StatusCode::kInvalidArgument, want)) << key << " = " << value;
  }
}

// Each RoPE variant transformers computes, in either spelling, with its keys read.
TEST(ModelConfigTest, RopeVariantsInEitherSpelling) {
  ASSERT_OK_AND_ASSIGN(ModelConfig yarn, Qwen25With("rope_scaling", R"({"type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768})"));
  EXPECT_EQ(yarn.rope.type, "yarn");
  EXPECT_EQ(yarn.rope.factor, 4.0);
  EXPECT_EQ(yarn.rope.original_max_position_embeddings, 32768);
  ASSERT_OK_AND_ASSIGN(ModelConfig llama3, Qwen25With("rope_parameters", R"({"rope_type": "llama3",
      "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})"));
  EXPECT_EQ(llama3.rope.type, "llama3");
  EXPECT_EQ(llama3.rope_theta, 1000000.0) << "the top-level rope_theta, as before";
  EXPECT_EQ(llama3.rope.high_freq_factor, 4.0);
  for (const char* type : {"linear", "dynamic"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig c, Qwen25With("rope_scaling", absl::StrCat(R"({"rope_type": ")", type, R"(", "factor": 2.0})")));
    EXPECT_EQ(c.rope.type, type);
    EXPECT_EQ(c.rope.factor, 2.0);
  }
  // Written back, a scaled RoPE reads as it was.
  ASSERT_OK_AND_ASSIGN(ModelConfig again, ParseModelConfigJson(ModelConfigToJson(llama3)));
  EXPECT_EQ(again.rope.type, "llama3");
  EXPECT_EQ(again.rope.original_max_position_embeddings, 8192);
}

// Qwen3 dense and Llama 3 as their presets write them.
TEST(ModelConfigTest, Qwen3AndLlamaFamilies) {
  for (const char* preset : {"tiny-qwen3", "qwen3-0.6b", "qwen3-8b", "tiny-llama", "llama-3.2-1b", "llama-3.1-8b"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelConfigPreset(preset));
    ASSERT_OK_AND_ASSIGN(ModelConfig back, ParseModelConfigJson(ModelConfigToJson(c)));
    EXPECT_EQ(back.model_type, c.model_type) << preset;
    EXPECT_FALSE(back.qkv_bias()) << preset;
    EXPECT_EQ(back.qk_norm(), c.model_type == "qwen3") << preset;
    EXPECT_EQ(back.rope.type, c.rope.type) << preset;
    EXPECT_EQ(back.head_dim(), c.head_dim()) << preset;
  }
  ASSERT_OK_AND_ASSIGN(ModelConfig llama, ModelConfigPreset("llama-3.1-8b"));
  EXPECT_NEAR(static_cast<double>(llama.TotalParameterCount()), 8.03e9, 0.01e9);
  ASSERT_OK_AND_ASSIGN(ModelConfig qwen3, ModelConfigPreset("qwen3-0.6b"));
  EXPECT_NEAR(static_cast<double>(qwen3.TotalParameterCount()), 0.596e9, 0.005e9);
}

// transformers 5 writes Qwen3-MoE's expert count as num_local_experts; earlier Hub configs
// say num_experts. Either spelling loads; both, disagreeing, are refused.
TEST(ModelConfigTest, BothSpellingsOfTheExpertCount) {
  std::string renamed = kQwen3Moe;
  renamed.replace(renamed.find("\"num_experts\""), 13, "\"num_local_experts\"");
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfigJson(renamed));
  EXPECT_EQ(c.moe.num_experts, 128);
  std::string both = kQwen3Moe;
  both.insert(both.rfind('}'), ", \"num_local_experts\": 64");
  EXPECT_THAT(ParseModelConfigJson(both),
              StatusIs(absl::StatusCode::kInvalidArgument, "num_local_experts: differs from num_experts"));
  std::string qkv = kQwen2Moe;
  qkv.insert(qkv.rfind('}'), ", \"qkv_bias\": false");
  EXPECT_THAT(ParseModelConfigJson(qkv), StatusIs(absl::StatusCode::kInvalidArgument, "qkv_bias: false"));
}

}  // namespace
}  // namespace lorastep
