// config.json parsing for dense Qwen2 and the MoE families (Qwen2-MoE, Qwen3-MoE), as
// transformers writes them; validation errors name the field.
#include "lib/model/model_config.h"

#include "tests/test_util.h"

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
  for (const char* name : {"tiny", "qwen2.5-0.5b", "tiny-moe", "qwen3-30b-a3b-reduced"}) {
    ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelConfigPreset(name));
    ASSERT_OK_AND_ASSIGN(ModelConfig back, ParseModelConfigJson(ModelConfigToJson(c)));
    EXPECT_EQ(back.model_type, c.model_type) << name;
    EXPECT_EQ(back.head_dim(), c.head_dim()) << name;
    EXPECT_EQ(back.moe.num_experts, c.moe.num_experts) << name;
    EXPECT_EQ(back.moe.num_experts_per_tok, c.moe.num_experts_per_tok) << name;
    EXPECT_EQ(back.moe.moe_intermediate_size, c.moe.moe_intermediate_size) << name;
    EXPECT_EQ(back.moe.shared_expert_intermediate_size, c.moe.shared_expert_intermediate_size) << name;
    EXPECT_EQ(back.moe.norm_topk_prob, c.moe.norm_topk_prob) << name;
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
  EXPECT_THAT(with("model_type", "\"llama\""), StatusIs(absl::StatusCode::kInvalidArgument, "model_type: unsupported"));
  EXPECT_THAT(with("model_type", "7"), StatusIs(absl::StatusCode::kInvalidArgument, "model_type: not a string"));
  EXPECT_THAT(with("head_dim", "-1"), StatusIs(absl::StatusCode::kInvalidArgument, "head_dim"));
  std::string shared = kQwen2Moe;
  shared.replace(shared.find("qwen2_moe"), 9, "qwen3_moe");
  EXPECT_THAT(ParseModelConfigJson(shared),
              StatusIs(absl::StatusCode::kInvalidArgument, "shared_expert_intermediate_size: qwen3_moe has no shared expert"));
}

}  // namespace
}  // namespace lorastep
