// (a) Model logits against a plain reference written here from the Qwen2 definition, and
// Hugging Face folder loading (single file and sharded).
#include <ATen/ATen.h>

#include <cmath>

#include "lib/io/file_util.h"
#include "lib/model/model_weights.h"
#include "lib/model/qwen2.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::RelErr;
using ::lorastep::testing::MaxAbsDiff;
using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

// Reference decoder in fp64, written independently of lib/: explicit loops over heads,
// explicit causal mask, explicit RoPE pairs.
at::Tensor ReferenceLogits(const ModelConfig& c, const ModelWeights& w, const at::Tensor& tokens) {
  auto f64 = [](const at::Tensor& t) { return t.to(at::kCPU, at::kDouble); };
  const int64_t s = tokens.size(1), nh = c.num_attention_heads, nkv = c.num_key_value_heads,
                d = c.head_dim();
  auto norm = [&](const at::Tensor& x, const at::Tensor& g) {
    return f64(g) * x / at::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps);
  };
  at::Tensor x = f64(w.embed_tokens).index_select(0, tokens[0].to(at::kCPU));  // [s, H]
  // RoPE angles: position p, pair j uses theta^(-2j/d); dims (j, j + d/2) rotate together.
  at::Tensor angle = at::empty({s, d / 2}, at::kDouble);
  for (int64_t p = 0; p < s; ++p)
    for (int64_t j = 0; j < d / 2; ++j)
      angle[p][j] = p * std::pow(c.rope_theta, -2.0 * j / d);
  auto rope = [&](const at::Tensor& v) {  // v: [s, d]
    at::Tensor a = v.narrow(1, 0, d / 2), b = v.narrow(1, d / 2, d / 2);
    return at::cat({a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()}, 1);
  };
  for (const LayerWeights& l : w.layers) {
    at::Tensor h = norm(x, l.input_norm);
    at::Tensor q = h.matmul(f64(l.linear[kQProj]).t()) + f64(l.qkv_bias[0]);
    at::Tensor k = h.matmul(f64(l.linear[kKProj]).t()) + f64(l.qkv_bias[1]);
    at::Tensor v = h.matmul(f64(l.linear[kVProj]).t()) + f64(l.qkv_bias[2]);
    std::vector<at::Tensor> heads;
    for (int64_t hd = 0; hd < nh; ++hd) {
      const int64_t g = hd / (nh / nkv);
      at::Tensor qh = rope(q.narrow(1, hd * d, d));
      at::Tensor kh = rope(k.narrow(1, g * d, d));
      at::Tensor vh = v.narrow(1, g * d, d);
      at::Tensor scores = qh.matmul(kh.t()) / std::sqrt(static_cast<double>(d));
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = i + 1; j < s; ++j) scores[i][j] = -INFINITY;
      heads.push_back(at::softmax(scores, 1).matmul(vh));
    }
    x = x + at::cat(heads, 1).matmul(f64(l.linear[kOProj]).t());
    h = norm(x, l.post_attention_norm);
    at::Tensor gate = h.matmul(f64(l.linear[kGateProj]).t());
    at::Tensor up = h.matmul(f64(l.linear[kUpProj]).t());
    x = x + (gate * at::sigmoid(gate) * up).matmul(f64(l.linear[kDownProj]).t());
  }
  x = norm(x, w.final_norm);
  return x.matmul(f64(w.output_weight()).t());
}

TEST(ModelTest, LogitsMatchPlainReferenceFp32) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  for (bool tied : {true, false}) {
    c.tie_word_embeddings = tied;
    ModelWeights w = RandomModelWeights(c, 7);
    at::Tensor tokens = at::randint(0, c.vocab_size, {1, 13}, at::kLong);
    ForwardOptions options;
    options.training = false;
    at::Tensor hidden = Qwen2Hidden(c, w, nullptr, tokens, options);
    at::Tensor logits = hidden.matmul(w.output_weight().t());
    at::Tensor ref = ReferenceLogits(c, w, tokens);
    EXPECT_LT(MaxAbsDiff(logits[0], ref), 1e-5) << "tied=" << tied;
    EXPECT_LT(RelErr(logits[0], ref), 1e-5);
  }
}

TEST(ModelTest, SaveAndLoadSingleAndShardedFolders) {
  const ModelConfig c = ModelConfigPreset("tiny").value();
  ModelWeights w = RandomModelWeights(c, 3);
  const std::string dir = ScratchDir("model_io");
  for (int shards : {1, 3}) {
    const std::string folder = dir + "/m" + std::to_string(shards);
    ASSERT_OK(SaveModel(folder, c, w, shards));
    ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(folder, at::kCPU));
    EXPECT_EQ(loaded.config.hidden_size, c.hidden_size);
    size_t count = 0;
    std::vector<at::Tensor> original;
    ForEachNamedTensor(w, [&](const std::string&, const at::Tensor& t) { original.push_back(t); });
    ForEachNamedTensor(loaded.weights, [&](const std::string& name, const at::Tensor& t) {
      EXPECT_TRUE(at::equal(t, original[count])) << name;
      ++count;
    });
    EXPECT_EQ(count, original.size());
  }
}

TEST(ModelTest, LoadErrorsNameTheTensor) {
  const ModelConfig c = ModelConfigPreset("tiny").value();
  ModelWeights w = RandomModelWeights(c, 3);
  const std::string dir = ScratchDir("model_bad");
  // Config says a larger hidden size than the file holds.
  ModelConfig wider = c;
  wider.intermediate_size = c.intermediate_size * 2;
  ASSERT_OK(SaveModel(dir + "/shape", c, w));
  ASSERT_OK(WriteStringToFile(dir + "/shape/config.json", ModelConfigToJson(wider)));
  EXPECT_THAT(LoadModel(dir + "/shape", at::kCPU),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor 'model.layers.0.mlp.gate_proj.weight': shape mismatch"));
  // A missing tensor.
  w.layers[1].post_attention_norm = at::Tensor();
  ModelWeights partial = w;
  ASSERT_OK(SaveModel(dir + "/missing", c, partial));
  EXPECT_THAT(LoadModel(dir + "/missing", at::kCPU),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "missing tensor 'model.layers.1.post_attention_layernorm.weight'"));
  EXPECT_THAT(LoadModel(dir + "/absent", at::kCPU), StatusIs(absl::StatusCode::kNotFound, "config.json"));
  // A MoE config over a dense model's file: the expert tensors are missing, by name.
  ASSERT_OK(WriteStringToFile(dir + "/shape/config.json", ModelConfigToJson(ModelConfigPreset("tiny-moe").value())));
  EXPECT_THAT(LoadModel(dir + "/shape", at::kCPU),
              StatusIs(absl::StatusCode::kInvalidArgument, "missing tensor 'model.layers.0.mlp.shared_expert.gate_proj.weight'"));
}

}  // namespace
}  // namespace lorastep
