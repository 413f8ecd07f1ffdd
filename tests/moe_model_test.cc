// MoE decoders (Qwen2-MoE with its shared expert, Qwen3-MoE with q/k norms and an explicit
// head_dim) against a plain fp64 reference written here from transformers' definitions
// (token by token: router softmax, top-k, renormalization, weighted experts); both expert
// layouts load; what is not built yet is refused by name.
#include <ATen/ATen.h>

#include <cmath>

#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/model/model_weights.h"
#include "lib/model/qwen2.h"
#include "lib/training/trainer.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::MaxAbsDiff;
using ::lorastep::testing::RelErr;
using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

ModelConfig Qwen3Tiny() {
  ModelConfig c = ModelConfigPreset("tiny-moe").value();
  c.model_type = "qwen3_moe";
  c.moe.shared_expert_intermediate_size = 0;
  c.head_dim_override = 16;  // 4 heads x 16 != hidden 32: q_proj is [64, 32]
  c.moe.mlp_only_layers = {0};
  c.moe.norm_topk_prob = false;
  c.tie_word_embeddings = false;
  return c;
}

at::Tensor ReferenceLogits(const ModelConfig& c, const ModelWeights& w, const at::Tensor& tokens) {
  auto f64 = [](const at::Tensor& t) { return t.to(at::kCPU, at::kDouble); };
  const int64_t s = tokens.size(1), nh = c.num_attention_heads, nkv = c.num_key_value_heads,
                d = c.head_dim(), k_top = c.moe.num_experts_per_tok;
  auto norm = [&](const at::Tensor& x, const at::Tensor& g) {
    return f64(g) * x / at::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps);
  };
  auto swiglu = [&](const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
    at::Tensor g = x.matmul(f64(gate).t()), u = x.matmul(f64(up).t());
    return (g * at::sigmoid(g) * u).matmul(f64(down).t());
  };
  at::Tensor x = f64(w.embed_tokens).index_select(0, tokens[0]);
  at::Tensor angle = at::empty({s, d / 2}, at::kDouble);
  for (int64_t p = 0; p < s; ++p)
    for (int64_t j = 0; j < d / 2; ++j) angle[p][j] = p * std::pow(c.rope_theta, -2.0 * j / d);
  auto rope = [&](const at::Tensor& v) {
    at::Tensor a = v.narrow(1, 0, d / 2), b = v.narrow(1, d / 2, d / 2);
    return at::cat({a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()}, 1);
  };
  for (const LayerWeights& l : w.layers) {
    at::Tensor h = norm(x, l.input_norm);
    at::Tensor q = h.matmul(f64(l.linear[kQProj]).t()), k = h.matmul(f64(l.linear[kKProj]).t()),
               v = h.matmul(f64(l.linear[kVProj]).t());
    if (l.layout.qkv_bias) {
      q = q + f64(l.qkv_bias[0]);
      k = k + f64(l.qkv_bias[1]);
      v = v + f64(l.qkv_bias[2]);
    }
    std::vector<at::Tensor> heads;
    for (int64_t hd = 0; hd < nh; ++hd) {
      const int64_t g = hd / (nh / nkv);
      at::Tensor qh = q.narrow(1, hd * d, d), kh = k.narrow(1, g * d, d);
      if (l.layout.qk_norm) {
        qh = norm(qh, l.q_norm);
        kh = norm(kh, l.k_norm);
      }
      at::Tensor scores = rope(qh).matmul(rope(kh).t()) / std::sqrt(static_cast<double>(d));
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = i + 1; j < s; ++j) scores[i][j] = -INFINITY;
      heads.push_back(at::softmax(scores, 1).matmul(v.narrow(1, g * d, d)));
    }
    x = x + at::cat(heads, 1).matmul(f64(l.linear[kOProj]).t());
    h = norm(x, l.post_attention_norm);
    if (!l.layout.moe) {
      x = x + swiglu(h, l.linear[kGateProj], l.linear[kUpProj], l.linear[kDownProj]);
      continue;
    }
    const int64_t f = l.experts_down.size(2);
    at::Tensor out = at::zeros_like(h);
    for (int64_t t = 0; t < s; ++t) {  // one token at a time
      at::Tensor xt = h.narrow(0, t, 1);
      at::Tensor probs = at::softmax(xt.matmul(f64(l.router).t())[0], 0);
      auto [p, e] = probs.topk(k_top);
      if (c.moe.norm_topk_prob) p = p / p.sum();
      for (int64_t j = 0; j < k_top; ++j) {
        const int64_t ex = e[j].item<int64_t>();
        at::Tensor gu = l.experts_gate_up[ex];
        out[t] += p[j].item<double>() *
                  swiglu(xt, gu.narrow(0, 0, f), gu.narrow(0, f, f), l.experts_down[ex])[0];
      }
    }
    if (l.layout.shared_expert_gate) {
      out = out + at::sigmoid(h.matmul(f64(l.shared_expert_gate).t())) *
                      swiglu(h, l.linear[kGateProj], l.linear[kUpProj], l.linear[kDownProj]);
    }
    x = x + out;
  }
  return norm(x, w.final_norm).matmul(f64(w.output_weight()).t());
}

TEST(MoeModelTest, LogitsMatchPlainReferenceBothFamilies) {
  for (const ModelConfig& c : {ModelConfigPreset("tiny-moe").value(), Qwen3Tiny(),
                               ModelConfigPreset("tiny-qwen3-moe").value()}) {
    ModelWeights w = RandomModelWeights(c, 5);
    for (auto& l : w.layers) {  // a router with a real preference, so top-k matters
      if (l.layout.moe) l.router = l.router * 50;
    }
    at::Tensor tokens = at::randint(0, c.vocab_size, {1, 11}, at::kLong);
    ForwardOptions options;
    options.training = false;
    at::Tensor logits = Qwen2Hidden(c, w, nullptr, tokens, options).matmul(w.output_weight().t());
    at::Tensor ref = ReferenceLogits(c, w, tokens);
    EXPECT_LT(RelErr(logits[0], ref), 1e-5) << c.model_type;
    EXPECT_LT(MaxAbsDiff(logits[0], ref), 1e-5) << c.model_type;
  }
}

TEST(MoeModelTest, StackedAndPerExpertLayoutsLoadTheSameWeights) {
  const ModelConfig c = ModelConfigPreset("tiny-moe").value();
  const ModelWeights w = RandomModelWeights(c, 9);
  const std::string dir = ScratchDir("moe_layouts");
  // SaveModel writes one module per expert, as save_pretrained does.
  ASSERT_OK(SaveModel(dir + "/per_expert", c, w));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile written, SafetensorsFile::Open(dir + "/per_expert/model.safetensors"));
  EXPECT_TRUE(written.Find("model.layers.0.mlp.experts.3.up_proj.weight").ok());
  EXPECT_FALSE(written.Find("model.layers.0.mlp.experts.gate_up_proj").ok());
  // transformers' in-memory names: stacked experts.
  TensorWriteList stacked;
  ForEachNamedTensor(w, [&](const std::string& name, const at::Tensor& t) { ASSERT_OK(stacked.Add(name, t)); });
  ASSERT_OK(MakeDirectories(dir + "/stacked"));
  ASSERT_OK(WriteStringToFile(dir + "/stacked/config.json", ModelConfigToJson(c)));
  ASSERT_OK(stacked.WriteTo(dir + "/stacked/model.safetensors"));
  ASSERT_OK_AND_ASSIGN(LoadedModel a, LoadModel(dir + "/stacked", at::kCPU));
  ASSERT_OK_AND_ASSIGN(LoadedModel b, LoadModel(dir + "/per_expert", at::kCPU));
  std::map<std::string, at::Tensor> from_a;
  ForEachNamedTensor(a.weights, [&](const std::string& name, const at::Tensor& t) { from_a[name] = t; });
  int compared = 0;
  ForEachNamedTensor(b.weights, [&](const std::string& name, const at::Tensor& t) {
    EXPECT_TRUE(at::equal(from_a.at(name), t)) << name;
    ++compared;
  });
  EXPECT_EQ(compared, static_cast<int>(from_a.size()));
  // One expert missing from a per-expert file is named.
  TensorWriteList partial;
  ASSERT_OK_AND_ASSIGN(SafetensorsFile full, SafetensorsFile::Open(dir + "/per_expert/model.safetensors"));
  std::vector<at::Tensor> keep;
  for (const auto& e : full.entries()) {
    if (e.name == "model.layers.1.mlp.experts.2.down_proj.weight") continue;
    keep.push_back(TensorFromEntry(e).value().clone());
    ASSERT_OK(partial.Add(e.name, keep.back()));
  }
  ASSERT_OK(partial.WriteTo(dir + "/per_expert/model.safetensors"));
  EXPECT_THAT(LoadModel(dir + "/per_expert", at::kCPU),
              StatusIs(absl::StatusCode::kInvalidArgument, "missing tensor 'model.layers.1.mlp.experts.2.down_proj.weight'"));
}

TEST(MoeModelTest, AttentionLoraTrainsAndWhatIsNotBuiltIsRefused) {
  const ModelConfig c = ModelConfigPreset("tiny-moe").value();
  const std::string dir = ScratchDir("moe_train");
  ASSERT_OK(SaveModel(dir, c, RandomModelWeights(c, 3)));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const BaseModel> base, LoadBaseModel(dir, "cpu", ""));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  EXPECT_THAT(Trainer::Create(base, o),  // all-linear includes the expert MLPs
              StatusIs(absl::StatusCode::kUnimplemented, "lora.target_modules: gate/up/down on a MoE model"));
  o.lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Trainer> trainer, Trainer::Create(base, o));
  std::vector<Datum> batch;
  for (int i = 0; i < 3; ++i) {
    Datum d;
    for (int j = 0; j < 9; ++j) {
      d.tokens.push_back((i * 7 + j * 3) % c.vocab_size);
      d.target_tokens.push_back((i * 5 + j * 11) % c.vocab_size);
    }
    batch.push_back(d);
  }
  AdamWParams adam;
  adam.lr = 1e-2;
  LossConfig ce;
  ASSERT_OK_AND_ASSIGN(OptimStepResult r1, trainer->TrainStep(batch, ce, adam));
  ASSERT_OK_AND_ASSIGN(OptimStepResult r2, trainer->TrainStep(batch, ce, adam));
  EXPECT_GT(r2.metrics.Get("grad_norm:sum"), 0);
  // Routing figures: a share of experts in (0, 1], a busiest-over-mean load >= 1.
  EXPECT_GT(r2.metrics.Get("moe_experts_hit:mean"), 0);
  EXPECT_LE(r2.metrics.Get("moe_experts_hit:mean"), 1);
  EXPECT_GE(r2.metrics.Get("moe_load_max_over_mean:max"), 1);
  EXPECT_LT(r2.metrics.Get("loss:sum"), r1.metrics.Get("loss:sum"));
  TrainerOptions full;
  full.lora.rank = 0;
  EXPECT_THAT(Trainer::Create(base, full), StatusIs(absl::StatusCode::kUnimplemented, "full fine-tuning of a MoE"));
  EXPECT_THAT(LoadBaseModel(dir, "cpu", "", {2, 1, 1}, {0, 0, 0}),
              StatusIs(absl::StatusCode::kUnimplemented, "sharding a qwen2_moe model"));
}

}  // namespace
}  // namespace lorastep
