// MoE decoders (Qwen2-MoE with its shared expert, Qwen3-MoE with q/k norms and an explicit
// head_dim) against a plain fp64 reference written here from transformers' definitions
// (token by token: router softmax, top-k, renormalization, weighted experts); both expert
// layouts load; what is not built yet is refused by name.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <array>
#include <cmath>

#include "absl/strings/match.h"
#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/model/model_weights.h"
#include "lib/model/peft_io.h"
#include "lib/model/qwen2.h"
#include "lib/training/grad_finalizer.h"
#include "lib/training/trainer.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

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

// Expert LoRA leaves for the reference, in the adapter's shapes (fp64, requiring grad), per
// stage-local layer; undefined where a layer has none.
struct ReferenceExpertLora {
  std::vector<std::array<at::Tensor, 4>> layers;  // fc1_a, fc1_b, fc2_a, fc2_b
  double scale = 1.0;
};

at::Tensor ReferenceLogits(const ModelConfig& c, const ModelWeights& w, const at::Tensor& tokens,
                           const ReferenceExpertLora* lora = nullptr) {
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
  for (size_t li = 0; li < w.layers.size(); ++li) {
    const LayerWeights& l = w.layers[li];
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
        if (lora == nullptr || !lora->layers[li][0].defined()) {
          out[t] += p[j].item<double>() *
                    swiglu(xt, gu.narrow(0, 0, f), gu.narrow(0, f, f), l.experts_down[ex])[0];
          continue;
        }
        // Plain per-expert dense LoRA: W x + s B_e (A_e x) on gate, up and down, where a
        // shared factor (2-D) is the same matrix for every expert.
        const auto& fl = lora->layers[li];
        auto of = [&](const at::Tensor& t) { return t.dim() == 2 ? t : t[ex]; };
        at::Tensor inner1 = xt.matmul(of(fl[0]).t());
        at::Tensor g = xt.matmul(f64(gu.narrow(0, 0, f)).t()) + lora->scale * inner1.matmul(fl[1][ex][0].t());
        at::Tensor u = xt.matmul(f64(gu.narrow(0, f, f)).t()) + lora->scale * inner1.matmul(fl[1][ex][1].t());
        at::Tensor act = g * at::sigmoid(g) * u;
        at::Tensor y = act.matmul(f64(l.experts_down[ex]).t()) +
                       lora->scale * act.matmul(fl[2][ex].t()).matmul(of(fl[3]).t());
        out[t] = out[t] + p[j] * y[0];  // the routing weight is differentiable too
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

// Expert LoRA (both layouts, fused and unfused weight gradients): logits and every expert
// factor's gradient against the plain per-expert fp64 reference above.
TEST(MoeModelTest, ExpertLoraMatchesPlainPerExpertReference) {
  for (const std::string family : {"qwen2_moe", "qwen3_moe"}) {
    for (const std::string layout : {"per_expert", "shared_outer"}) {
      for (const bool fused : {true, false}) {
        SCOPED_TRACE(family + " " + layout + (fused ? " fused" : " unfused"));
        ModelConfig c = family == "qwen2_moe" ? ModelConfigPreset("tiny-moe").value() : Qwen3Tiny();
        c.torch_dtype = "float32";
        // fp32 on the device under test (the GPU run too: a bf16 router could pick other
        // experts than the fp64 reference near a tie).
        const at::Device device = ::lorastep::testing::TestDevice();
        ModelWeights w = RandomModelWeights(c, 5);
        ForEachNamedTensor(w, [&](const std::string&, at::Tensor& t) { t = t.to(device); });
        LoraConfig lc;
        lc.rank = 4;
        lc.alpha = 8;
        lc.expert_lora = layout;
        ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lc, device, at::kFloat, 9));
        // Nonzero B (the zero init would hide A's gradient) and the reference's leaves.
        ReferenceExpertLora ref;
        ref.scale = lc.scale();
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
        for (size_t layer = 0; layer < w.layers.size(); ++layer) {
          std::array<at::Tensor, 4> leaves;
          const ExpertLoraFactors* f = adapter.expert_lora(layer);
          if (f != nullptr) {
            int k = 0;
            for (int index : {f->fc1_a, f->fc1_b, f->fc2_a, f->fc2_b}) {
              Parameter& p = adapter.parameters()[index];
              if (k == 1 || k == 3) {
                at::NoGradGuard no_grad;
                p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0, 0.2, gen));
              }
              leaves[k++] = p.value.detach().to(at::kCPU, at::kDouble).requires_grad_(true);
            }
          }
          ref.layers.push_back(leaves);
        }
        at::Tensor tokens = at::randint(c.vocab_size, {1, 11}, at::kLong);
        at::Tensor weights = at::randn({11, c.vocab_size}, at::kDouble);
        ForwardOptions options;
        options.grad.fused_wgrad = fused;
        at::Tensor hidden = Qwen2Hidden(c, w, &adapter, tokens.to(device), options);
        at::Tensor logits = hidden.matmul(w.output_weight().t())[0].to(at::kCPU);
        at::Tensor want = ReferenceLogits(c, w, tokens, &ref);
        EXPECT_LT(MaxAbsDiff(logits.to(at::kDouble), want), 1e-5);
        (logits.to(at::kDouble) * weights).sum().backward();
        (want * weights).sum().backward();
        ASSERT_OK(FoldLocalGradients(&adapter));
        int compared = 0;
        for (size_t layer = 0; layer < w.layers.size(); ++layer) {
          const ExpertLoraFactors* f = adapter.expert_lora(layer);
          if (f == nullptr) continue;
          int k = 0;
          for (int index : {f->fc1_a, f->fc1_b, f->fc2_a, f->fc2_b}) {
            const Parameter& p = adapter.parameters()[index];
            const at::Tensor& g = ref.layers[layer][k++].grad();
            SCOPED_TRACE(p.name);
            ASSERT_TRUE(g.defined());
            EXPECT_GT(g.abs().max().item<double>(), 0);
            EXPECT_LT(RelErr(p.main_grad.to(at::kDouble), g), 1e-5);
            ++compared;
          }
        }
        EXPECT_EQ(compared, 4 * (family == "qwen2_moe" ? 2 : 1));
        // Shared-outer factors are registered by kind and shape: fc1's A and fc2's B of each
        // MoE layer, in key order.
        if (layout == "shared_outer") {
          ASSERT_EQ(adapter.shared_factors().size(), family == "qwen2_moe" ? 4u : 2u);
          for (const SharedFactor& sf : adapter.shared_factors()) {
            EXPECT_EQ(adapter.parameters()[sf.param].role, kSharedExpert);
            EXPECT_EQ(sf.shape.size(), 2u);
          }
        } else {
          EXPECT_TRUE(adapter.shared_factors().empty());
        }
      }
    }
  }
}

// PEFT export and import of expert LoRA: per-expert keys; shared-outer compact (shared
// factors once per layer) and expanded (a copy per expert). The expanded shared-outer
// export loads into a per-expert adapter that computes the same logits.
TEST(MoeModelTest, ExpertLoraPeftExportAndImport) {
  ModelConfig c = ModelConfigPreset("tiny-moe").value();
  const ModelWeights w = RandomModelWeights(c, 5);
  const std::string dir = ScratchDir("moe_peft");
  auto make = [&](const std::string& layout, uint64_t seed) {
    LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 8;
    lc.expert_lora = layout;
    Adapter a = Adapter::CreateLora(c, lc, at::kCPU, at::kFloat, seed).value();
    at::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 100);
    for (Parameter& p : a.parameters()) p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0, 0.1, gen));
    return a;
  };
  at::Tensor tokens = at::randint(c.vocab_size, {1, 9}, at::kLong);
  auto logits = [&](const Adapter& a) {
    at::NoGradGuard no_grad;
    return Qwen2Hidden(c, w, &a, tokens, ForwardOptions{});
  };
  // Per-expert: the documented keys, and a round trip.
  Adapter per = make("per_expert", 1);
  ASSERT_OK(ExportPeftAdapter(dir + "/per", per, "base"));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(dir + "/per/adapter_model.safetensors"));
  const std::string l0 = "base_model.model.model.layers.0.mlp.experts.";
  for (const char* key : {"3.gate_proj.lora_A.weight", "3.gate_proj.lora_B.weight", "3.up_proj.lora_A.weight",
                          "3.up_proj.lora_B.weight", "3.down_proj.lora_A.weight", "3.down_proj.lora_B.weight"}) {
    EXPECT_TRUE(file.Find(l0 + key).ok()) << key;
  }
  ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* gate_b, file.Find(l0 + "3.gate_proj.lora_B.weight"));
  EXPECT_EQ(gate_b->shape, (std::vector<int64_t>{c.moe.moe_intermediate_size, 4}));
  Adapter per2 = make("per_expert", 2);
  ASSERT_OK(ImportPeftAdapter(dir + "/per", &per2));
  EXPECT_EQ(MaxAbsDiff(logits(per2), logits(per)), 0);
  // Shared-outer, compact: shared factors without the expert index.
  Adapter shared = make("shared_outer", 3);
  ASSERT_OK(ExportPeftAdapter(dir + "/shared", shared, "base"));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile compact, SafetensorsFile::Open(dir + "/shared/adapter_model.safetensors"));
  EXPECT_TRUE(compact.Find(l0 + "gate_proj.lora_A.weight").ok());
  EXPECT_TRUE(compact.Find(l0 + "down_proj.lora_B.weight").ok());
  EXPECT_FALSE(compact.Find(l0 + "0.gate_proj.lora_A.weight").ok());
  Adapter shared2 = make("shared_outer", 4);
  ASSERT_OK(ImportPeftAdapter(dir + "/shared", &shared2));
  EXPECT_EQ(MaxAbsDiff(logits(shared2), logits(shared)), 0);
  // Expanded: a plain per-expert adapter with the same function.
  ASSERT_OK(ExportPeftAdapter(dir + "/expanded", shared, "base", nullptr, PeftExportOptions{true, c.moe.num_experts}));
  Adapter as_per = make("per_expert", 5);
  ASSERT_OK(ImportPeftAdapter(dir + "/expanded", &as_per));
  EXPECT_LT(MaxAbsDiff(logits(as_per), logits(shared)), 1e-6);
  Adapter shared3 = make("shared_outer", 6);
  ASSERT_OK(ImportPeftAdapter(dir + "/expanded", &shared3));  // and back
  EXPECT_EQ(MaxAbsDiff(logits(shared3), logits(shared)), 0);
  // A per-expert adapter whose experts' A differ is not shared-outer: refused, nothing changed.
  const at::Tensor before = logits(shared3);
  EXPECT_THAT(ImportPeftAdapter(dir + "/per", &shared3),
              StatusIs(absl::StatusCode::kInvalidArgument, "differs from the copy it must equal"));
  EXPECT_EQ(MaxAbsDiff(logits(shared3), before), 0);
  // A missing expert key is named.
  EXPECT_THAT(ImportPeftAdapter(dir + "/shared", &per2),
              StatusIs(absl::StatusCode::kInvalidArgument, "missing tensor 'base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight'"));
}

// On CUDA in bf16 the experts run as grouped GEMMs: same logits and expert-factor
// gradients as the per-expert loop, within bf16 rounding (both layouts, fused and unfused).
TEST(MoeModelTest, GroupedExpertsMatchThePerExpertLoop) {
  const at::Device device = ::lorastep::testing::TestDevice();
  if (!GroupedLinearAvailable(at::zeros({8, 8}, at::TensorOptions().device(device).dtype(at::kBFloat16)), {8})) {
    GTEST_SKIP() << "no grouped GEMM on " << device << " with this torch";
  }
  ModelConfig c = ModelConfigPreset("tiny-moe").value();
  ModelWeights w = RandomModelWeights(c, 5);
  ForEachNamedTensor(w, [&](const std::string&, at::Tensor& t) { t = t.to(device, at::kBFloat16); });
  at::Tensor tokens = at::randint(c.vocab_size, {2, 13}, at::kLong).to(device);
  for (const std::string layout : {"per_expert", "shared_outer"}) {
    for (const bool fused : {true, false}) {
      SCOPED_TRACE(layout + (fused ? " fused" : " unfused"));
      std::vector<at::Tensor> out, grads;
      for (const bool grouped : {true, false}) {
        LoraConfig lc;
        lc.rank = 8;
        lc.alpha = 16;
        lc.expert_lora = layout;
        ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lc, device, at::kBFloat16, 9));
        {
          at::NoGradGuard no_grad;
          at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
          for (Parameter& p : adapter.parameters()) {
            if (absl::EndsWith(p.name, "lora_B.weight")) {
              p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0, 0.2, gen));
            }
          }
        }
        ForwardOptions options;
        options.grad.fused_wgrad = fused;
        options.grouped_experts = grouped;
        at::Tensor h = Qwen2Hidden(c, w, &adapter, tokens, options);
        h.to(at::kFloat).pow(2).sum().backward();
        ASSERT_OK(FoldLocalGradients(&adapter));
        out.push_back(h.to(at::kCPU, at::kFloat));
        std::vector<at::Tensor> g;
        for (const Parameter& p : adapter.parameters()) {
          if (!p.family.empty()) g.push_back(p.main_grad.reshape({-1}).to(at::kCPU));
        }
        grads.push_back(at::cat(g));
      }
      EXPECT_LT(RelErr(out[0], out[1]), 1e-2);
      EXPECT_LT(RelErr(grads[0], grads[1]), 3e-2);
      EXPECT_GT(grads[1].abs().max().item<double>(), 0);
    }
  }
}

TEST(MoeModelTest, ExpertLoraTrainsAndWhatIsNotBuiltIsRefused) {
  const ModelConfig c = ModelConfigPreset("tiny-moe").value();
  const std::string dir = ScratchDir("moe_train");
  ASSERT_OK(SaveModel(dir, c, RandomModelWeights(c, 3)));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const BaseModel> base, LoadBaseModel(dir, "cpu", ""));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.lora.target_modules = {"q_proj", "gate_proj"};
  EXPECT_THAT(Trainer::Create(base, o),
              StatusIs(absl::StatusCode::kInvalidArgument, "gate_proj and up_proj go together"));
  o.lora.target_modules = {"all-linear"};
  o.lora.expert_lora = "grouped";
  EXPECT_THAT(Trainer::Create(base, o), StatusIs(absl::StatusCode::kInvalidArgument, "lora.expert_lora: unknown 'grouped'"));
  std::vector<Datum> batch;
  for (int i = 0; i < 3; ++i) {
    Datum d;
    for (int j = 0; j < 9; ++j) {
      d.tokens.push_back((i * 7 + j * 3) % c.vocab_size);
      d.target_tokens.push_back((i * 5 + j * 11) % c.vocab_size);
    }
    batch.push_back(d);
  }
  for (const std::string layout : {"per_expert", "shared_outer"}) {
    SCOPED_TRACE(layout);
    o.lora.expert_lora = layout;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Trainer> trainer, Trainer::Create(base, o));
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
    // One copy: no replica digests to compare (the mesh tests check them).
    EXPECT_TRUE(r2.replica_digests.empty());
  }
  TrainerOptions full;
  full.lora.rank = 0;
  EXPECT_THAT(Trainer::Create(base, full), StatusIs(absl::StatusCode::kUnimplemented, "full fine-tuning of a MoE"));
}

}  // namespace
}  // namespace lorastep
