// gpt-oss (model_type gpt_oss) against a plain fp64 reference written here from transformers'
// GptOss definitions, computed from the tensors as stored in the folder (experts [E, in, out]
// with gate and up in alternate columns): attention with q/k/v/o biases, a sliding-window
// layer and a sink column in each softmax; a biased router with a softmax over its top-k
// logits; experts with biases through the clamped SwiGLU, one token and expert at a time.
// Also: its config.json keys, MXFP4 experts, packed rows, and PEFT's target_parameters form.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <array>
#include <cmath>
#include <map>

#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/model/gpt_oss_layout.h"
#include "lib/model/layer_ops.h"
#include "lib/model/model_weights.h"
#include "lib/model/peft_io.h"
#include "lib/model/qwen2.h"
#include "lib/model/rope.h"
#include "lib/training/grad_finalizer.h"
#include "tests/model_test_util.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ExpectPackedRowsEqualAlone;
using ::lorastep::testing::MaxAbsDiff;
using ::lorastep::testing::RelErr;
using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;
using ::lorastep::testing::StoredTensors;

// The tiny preset with a low clamp (random weights give small activations; this makes the
// clamp of both gate and up cut some of them) and sinks of a visible size.
ModelConfig TinyGptOss() {
  ModelConfig c = ModelConfigPreset("tiny-gpt-oss").value();
  c.moe.swiglu_limit = 0.03;
  return c;
}

ModelWeights TinyWeights(const ModelConfig& c, uint64_t seed) {
  ModelWeights w = RandomModelWeights(c, seed);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  for (LayerWeights& l : w.layers) {
    l.sinks = at::empty(l.sinks.sizes(), at::kFloat).normal_(0, 1, gen).to(l.sinks.scalar_type());
    l.router = l.router * 50;  // a real preference, so the top-k matters
  }
  return w;
}

// LoRA leaves of the reference (fp64, requiring grad), per layer: q, k, v, o as {A, B}, and
// the experts' fc1_a, fc1_b, fc2_a, fc2_b in the adapter's shapes.
struct ReferenceLora {
  std::vector<std::array<std::array<at::Tensor, 2>, 4>> attention;
  std::vector<std::array<at::Tensor, 4>> experts;
  double scale = 1;
};

// Logits [s, V] of one sequence (tokens [s]) from the stored tensors `t`.
at::Tensor ReferenceLogits(const ModelConfig& c, std::map<std::string, at::Tensor>& t, const at::Tensor& tokens,
                           const ReferenceLora* lora = nullptr) {
  const int64_t s = tokens.size(0), nh = c.num_attention_heads, nkv = c.num_key_value_heads, d = c.head_dim(),
                top = c.moe.num_experts_per_tok, f = c.moe.moe_intermediate_size;
  const double limit = c.moe.swiglu_limit, alpha = c.moe.swiglu_alpha;
  auto norm = [&](const at::Tensor& x, const at::Tensor& g) {
    return g * (x / at::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps));
  };
  // RoPE tables (rope_test checks them against transformers' YaRN): rotate halves.
  auto [cos32, sin32] = RopeTables(c, s, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor cos = cos32.to(at::kDouble), sin = sin32.to(at::kDouble);
  auto rope = [&](const at::Tensor& v) {
    at::Tensor a = v.narrow(1, 0, d / 2), b = v.narrow(1, d / 2, d / 2);
    return v * cos + at::cat({-b, a}, 1) * sin;
  };
  at::Tensor x = t.at("model.embed_tokens.weight").index_select(0, tokens);
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const std::string p = "model.layers." + std::to_string(li) + ".";
    at::Tensor h = norm(x, t.at(p + "input_layernorm.weight"));
    auto linear = [&](const char* m, int slot) {
      at::Tensor y = h.matmul(t.at(p + "self_attn." + m + ".weight").t()) + t.at(p + "self_attn." + m + ".bias");
      if (lora != nullptr && lora->attention[li][slot][0].defined()) {
        y = y + lora->scale * h.matmul(lora->attention[li][slot][0].t()).matmul(lora->attention[li][slot][1].t());
      }
      return y;
    };
    at::Tensor q = linear("q_proj", 0), k = linear("k_proj", 1), v = linear("v_proj", 2);
    const int64_t window = c.AttentionWindow(li);
    const at::Tensor& sinks = t.at(p + "self_attn.sinks");
    std::vector<at::Tensor> heads;
    for (int64_t hd = 0; hd < nh; ++hd) {
      const int64_t g = hd / (nh / nkv);
      at::Tensor scores = rope(q.narrow(1, hd * d, d)).matmul(rope(k.narrow(1, g * d, d)).t()) / std::sqrt(double(d));
      for (int64_t i = 0; i < s; ++i) {
        for (int64_t j = 0; j < s; ++j) {
          if (j > i || (window > 0 && i - j >= window)) scores[i][j] = -INFINITY;
        }
      }
      at::Tensor with_sink = at::cat({scores, sinks[hd].expand({s, 1})}, 1);  // the sink column
      heads.push_back(at::softmax(with_sink, 1).narrow(1, 0, s).matmul(v.narrow(1, g * d, d)));
    }
    h = at::cat(heads, 1);
    x = x + linear("o_proj", 3);
    h = norm(x, t.at(p + "post_attention_layernorm.weight"));
    const at::Tensor& gate_up = t.at(p + "mlp.experts.gate_up_proj");  // [E, H, 2I]: gate even, up odd
    const at::Tensor& gate_up_bias = t.at(p + "mlp.experts.gate_up_proj_bias");
    const at::Tensor& down = t.at(p + "mlp.experts.down_proj");  // [E, I, H]
    const at::Tensor& down_bias = t.at(p + "mlp.experts.down_proj_bias");
    at::Tensor logits = h.matmul(t.at(p + "mlp.router.weight").t()) + t.at(p + "mlp.router.bias");
    at::Tensor out = at::zeros_like(h);
    for (int64_t tok = 0; tok < s; ++tok) {
      auto [top_logits, experts] = logits[tok].topk(top);
      at::Tensor weight = at::softmax(top_logits, 0);
      for (int64_t j = 0; j < top; ++j) {
        const int64_t e = experts[j].item<int64_t>();
        at::Tensor xt = h.narrow(0, tok, 1);
        at::Tensor gu = xt.matmul(gate_up[e]) + gate_up_bias[e];
        at::Tensor gate = gu.slice(1, 0, 2 * f, 2), up = gu.slice(1, 1, 2 * f, 2);
        if (lora != nullptr && lora->experts[li][0].defined()) {  // LoRA on the expert weights
          const auto& fl = lora->experts[li];
          auto of = [&](const at::Tensor& a) { return a.dim() == 2 ? a : a[e]; };
          at::Tensor inner = xt.matmul(of(fl[0]).t());
          gate = gate + lora->scale * inner.matmul(fl[1][e][0].t());
          up = up + lora->scale * inner.matmul(fl[1][e][1].t());
        }
        gate = gate.clamp_max(limit);
        up = up.clamp(-limit, limit);
        at::Tensor act = (up + 1) * gate * at::sigmoid(gate * alpha);
        at::Tensor y = act.matmul(down[e]) + down_bias[e];
        if (lora != nullptr && lora->experts[li][2].defined()) {
          const auto& fl = lora->experts[li];
          y = y + lora->scale * act.matmul(fl[2][e].t()).matmul((fl[3].dim() == 2 ? fl[3] : fl[3][e]).t());
        }
        out[tok] = out[tok] + weight[j] * y[0];
      }
    }
    x = x + out;
  }
  return norm(x, t.at("model.norm.weight")).matmul(t.at("lm_head.weight").t());
}

TEST(GptOssModelTest, ConfigReadsTransformersKeys) {
  const std::string gpt_oss_20b = R"({
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "sliding_window": 128, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": false},
    "max_position_embeddings": 131072, "swiglu_limit": 7.0, "tie_word_embeddings": false, "attention_bias": true,
    "attention_dropout": 0.0, "hidden_act": "silu", "initial_context_length": 4096,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"], "quant_method": "mxfp4"},
    "router_aux_loss_coef": 0.9, "output_router_logits": false, "torch_dtype": "bfloat16", "use_cache": true,
    "eos_token_id": 200002, "pad_token_id": 199999})";
  // The Hub's file has keys transformers ignores (experts_per_token, initial_context_length):
  // refused by name, as everywhere; without them the config reads.
  EXPECT_THAT(ParseModelConfigJson(gpt_oss_20b), StatusIs(absl::StatusCode::kInvalidArgument, "experts_per_token"));
  std::string text = gpt_oss_20b;
  for (const std::string key : {"\"experts_per_token\": 4, ", "\"initial_context_length\": 4096,"}) {
    text.erase(text.find(key), key.size());
  }
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfigJson(text));
  EXPECT_TRUE(c.gpt_oss() && c.is_moe() && c.attention_sinks() && c.o_bias() && c.router_bias());
  EXPECT_EQ(c.moe.num_experts, 32);
  EXPECT_EQ(c.moe.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe.moe_intermediate_size, 2880);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.AttentionWindow(0), 128);
  EXPECT_EQ(c.AttentionWindow(1), 0);
  EXPECT_EQ(c.AttentionWindow(22), 128);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.quantization, "mxfp4");
  EXPECT_DOUBLE_EQ(c.moe.swiglu_limit, 7.0);
  EXPECT_DOUBLE_EQ(c.moe.swiglu_alpha, 1.702);
  EXPECT_FALSE(c.tie_word_embeddings);
  // Written back, read again: the same model.
  ASSERT_OK_AND_ASSIGN(ModelConfig again, ParseModelConfigJson(ModelConfigToJson(c)));
  EXPECT_EQ(again.sliding_layers, c.sliding_layers);
  EXPECT_EQ(again.moe.num_experts, 32);
  EXPECT_EQ(again.rope.factor, 32);
  EXPECT_EQ(again.TotalParameterCount(), c.TotalParameterCount());
  // What is not built is refused by name.
  auto with = [&](const std::string& from, const std::string& to) {
    std::string edited = text;
    edited.replace(edited.find(from), from.size(), to);
    return ParseModelConfigJson(edited);
  };
  EXPECT_THAT(with(R"("quant_method": "mxfp4")", R"("quant_method": "fp8")"),
              StatusIs(absl::StatusCode::kInvalidArgument, "quantization_config.quant_method"));
  EXPECT_THAT(with(R"("attention_bias": true)", R"("attention_bias": false)"),
              StatusIs(absl::StatusCode::kInvalidArgument, "attention_bias"));
  EXPECT_THAT(with(R"("hidden_act": "silu")", R"("hidden_act": "silu", "use_sliding_window": true)"),
              StatusIs(absl::StatusCode::kInvalidArgument, "use_sliding_window"));
  EXPECT_THAT(with(R"("swiglu_limit": 7.0)", R"("swiglu_limit": 0)"),
              StatusIs(absl::StatusCode::kInvalidArgument, "swiglu_limit"));
  // Without layer_types even layers slide (above); a list of another length is refused.
  EXPECT_THAT(with(R"("hidden_act": "silu")", R"("hidden_act": "silu", "layer_types": ["full_attention"])"),
              StatusIs(absl::StatusCode::kInvalidArgument, "layer_types"));
}

// The stored layout round-trips, and gate/up sit in alternate columns of the stored tensor.
// MXFP4 blocks and scales dequantize as the format defines (a plain per-value decode here).
TEST(GptOssModelTest, StoredExpertLayoutAndMxfp4) {
  const ModelConfig c = TinyGptOss();
  const ModelWeights w = TinyWeights(c, 3);
  const std::string dir = ScratchDir("gpt_oss_layout");
  ASSERT_OK(SaveModel(dir + "/bf", c, w));
  std::map<std::string, at::Tensor> stored = StoredTensors(dir + "/bf");
  const int64_t f = c.moe.moe_intermediate_size;
  const at::Tensor& gu = stored.at("model.layers.1.mlp.experts.gate_up_proj");
  EXPECT_EQ(gu.sizes(), (at::IntArrayRef{4, 32, 2 * f}));
  EXPECT_EQ(MaxAbsDiff(gu.slice(2, 0, 2 * f, 2)[2], w.layers[1].experts_gate_up[2].narrow(0, 0, f).t().to(at::kDouble)), 0);
  EXPECT_EQ(MaxAbsDiff(gu.slice(2, 1, 2 * f, 2)[2], w.layers[1].experts_gate_up[2].narrow(0, f, f).t().to(at::kDouble)), 0);
  EXPECT_EQ(MaxAbsDiff(stored.at("model.layers.1.mlp.experts.gate_up_proj_bias").slice(1, 1, 2 * f, 2),
                       w.layers[1].experts_gate_up_bias.narrow(1, f, f).to(at::kDouble)),
            0);
  EXPECT_TRUE(stored.count("model.layers.0.self_attn.sinks") && stored.count("model.layers.0.mlp.router.bias") &&
              stored.count("model.layers.0.self_attn.o_proj.bias"));
  ASSERT_OK_AND_ASSIGN(LoadedModel loaded, LoadModel(dir + "/bf", at::kCPU));
  std::map<std::string, at::Tensor> original;
  ForEachNamedTensor(w, [&](const std::string& name, const at::Tensor& t) { original[name] = t; });
  ForEachNamedTensor(loaded.weights, [&](const std::string& name, const at::Tensor& t) {
    EXPECT_EQ(MaxAbsDiff(t, original.at(name)), 0) << name;
  });

  // MXFP4: every expert matrix as blocks [E, out, in / 32, 16] and scales [E, out, in / 32].
  ModelConfig q = c;
  q.hidden_size = 64;  // in-features a multiple of 32 for both matrices (H and I)
  q.moe.moe_intermediate_size = q.intermediate_size = 32;
  const ModelWeights qw = RandomModelWeights(q, 4);
  ASSERT_OK(SaveModel(dir + "/mx", q, qw));
  std::map<std::string, at::Tensor> want;  // name -> lorastep's layout, decoded here
  TensorWriteList list;
  std::vector<at::Tensor> keep;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  static const double kE2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(dir + "/mx/model.safetensors"));
  for (const auto& e : file.entries()) {
    const GptOssExpertTensor which = GptOssExpertTensorOf(e.name);
    if (which != GptOssExpertTensor::kGateUp && which != GptOssExpertTensor::kDown) {
      keep.push_back(TensorFromEntry(e).value().clone());
      ASSERT_OK(list.Add(e.name, keep.back()));
      continue;
    }
    const int64_t experts = e.shape[0], out = e.shape[2], in = e.shape[1], groups = in / 32;
    at::Tensor blocks = at::randint(0, 256, {experts, out, groups, 16}, gen, at::kLong).to(at::kByte);
    at::Tensor scales = at::randint(120, 130, {experts, out, groups}, gen, at::kLong).to(at::kByte);
    at::Tensor dense = at::empty({experts, out, in}, at::kDouble);  // [E, out, in], gate/up rows alternating
    auto b = blocks.accessor<uint8_t, 4>();
    auto sc = scales.accessor<uint8_t, 3>();
    auto dn = dense.accessor<double, 3>();
    for (int64_t x = 0; x < experts; ++x)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const uint8_t byte = b[x][o][i / 32][(i % 32) / 2];
          dn[x][o][i] = kE2M1[i % 2 == 0 ? byte & 15 : byte >> 4] * std::ldexp(1.0, sc[x][o][i / 32] - 127);
        }
    want[e.name] = GptOssFromStored(which, dense.transpose(1, 2));
    keep.push_back(blocks);
    ASSERT_OK(list.Add(e.name + "_blocks", blocks));
    keep.push_back(scales);
    ASSERT_OK(list.Add(e.name + "_scales", scales));
  }
  ASSERT_OK(list.WriteTo(dir + "/mx/model.safetensors"));
  ASSERT_OK_AND_ASSIGN(LoadedModel mx, LoadModel(dir + "/mx", at::kCPU, at::kFloat));
  {  // blocks of another dtype are refused by name
    TensorWriteList bad;
    ASSERT_OK_AND_ASSIGN(SafetensorsFile good, SafetensorsFile::Open(dir + "/mx/model.safetensors"));
    std::vector<at::Tensor> held;
    for (const auto& e : good.entries()) {
      at::Tensor t = TensorFromEntry(e).value().clone();
      if (e.name.find("down_proj_blocks") != std::string::npos) t = t.to(at::kChar);
      held.push_back(t);
      ASSERT_OK(bad.Add(e.name, held.back()));
    }
    ASSERT_OK(MakeDirectories(dir + "/mx_bad"));
    ASSERT_OK(bad.WriteTo(dir + "/mx_bad/model.safetensors"));
    ASSERT_OK(WriteStringToFile(dir + "/mx_bad/config.json", ReadFileToString(dir + "/mx/config.json").value()));
    EXPECT_THAT(LoadModel(dir + "/mx_bad", at::kCPU, at::kFloat),
                StatusIs(absl::StatusCode::kInvalidArgument, "MXFP4 tensors must be U8"));
  }
  {  // MXFP4 groups of 32 values: an expert width that is not a multiple of 32 is refused
    ASSERT_OK_AND_ASSIGN(SafetensorsFile bf, SafetensorsFile::Open(dir + "/bf/model.safetensors"));
    TensorWriteList odd;
    std::vector<at::Tensor> held;
    for (const auto& e : bf.entries()) {
      const bool down = GptOssExpertTensorOf(e.name) == GptOssExpertTensor::kDown;
      held.push_back(down ? at::zeros({4, 32, 1, 16}, at::kByte) : TensorFromEntry(e).value().clone());
      ASSERT_OK(odd.Add(down ? e.name + "_blocks" : e.name, held.back()));
    }
    ASSERT_OK(MakeDirectories(dir + "/mx_odd"));
    ASSERT_OK(odd.WriteTo(dir + "/mx_odd/model.safetensors"));
    ASSERT_OK(WriteStringToFile(dir + "/mx_odd/config.json", ReadFileToString(dir + "/bf/config.json").value()));
    EXPECT_THAT(LoadModel(dir + "/mx_odd", at::kCPU),
                StatusIs(absl::StatusCode::kInvalidArgument, "in-features 16 not a multiple of 32"));
  }
  int checked = 0;
  ForEachNamedTensor(mx.weights, [&](const std::string& name, const at::Tensor& t) {
    if (!want.count(name)) return;
    EXPECT_EQ(MaxAbsDiff(t.to(at::kDouble), want.at(name)), 0) << name;
    ++checked;
  });
  EXPECT_EQ(checked, 2 * q.num_hidden_layers);
}

// Log-probs, and every LoRA factor's gradient (attention projections and experts, both expert
// layouts), against the reference over the stored tensors.
TEST(GptOssModelTest, LogitsAndLoraGradientsMatchPlainReference) {
  at::manual_seed(0);
  const ModelConfig c = TinyGptOss();
  const ModelWeights w = TinyWeights(c, 5);
  const std::string dir = ScratchDir("gpt_oss_ref");
  ASSERT_OK(SaveModel(dir, c, w));
  std::map<std::string, at::Tensor> stored = StoredTensors(dir);
  ASSERT_OK_AND_ASSIGN(LoadedModel model, LoadModel(dir, at::kCPU));
  const at::Tensor tokens = at::randint(c.vocab_size, {1, 11}, at::kLong);
  {  // the base model
    at::NoGradGuard no_grad;
    ForwardOptions options;
    options.training = false;
    at::Tensor logits = Qwen2Hidden(c, model.weights, nullptr, tokens, options).matmul(w.output_weight().t())[0];
    at::Tensor ref = ReferenceLogits(c, stored, tokens[0]);
    EXPECT_LT(MaxAbsDiff(logits.to(at::kDouble), ref), 1e-5);
    // The clamp cuts in this model: without it the logits differ.
    ModelConfig unclamped = c;
    unclamped.moe.swiglu_limit = 7;
    at::Tensor free = Qwen2Hidden(unclamped, model.weights, nullptr, tokens, options).matmul(w.output_weight().t())[0];
    EXPECT_GT(MaxAbsDiff(free, logits), 1e-4);
  }
  for (const std::string layout : {"per_expert", "shared_outer"}) {
    for (const bool fused : {true, false}) {
      SCOPED_TRACE(layout + (fused ? " fused" : " unfused"));
      LoraConfig lc;
      lc.rank = 4;
      lc.alpha = 8;
      lc.expert_lora = layout;
      lc.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"};
      ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lc, at::kCPU, at::kFloat, 9));
      ReferenceLora ref;
      ref.scale = lc.scale();
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
      auto leaf = [&](int index, bool randomize) {
        Parameter& p = adapter.parameters()[index];
        if (randomize) {  // nonzero B: the zero init would hide A's gradient
          at::NoGradGuard no_grad;
          p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0, 0.3, gen));
        }
        return p.value.detach().to(at::kDouble).requires_grad_(true);
      };
      for (size_t layer = 0; layer < w.layers.size(); ++layer) {
        std::array<std::array<at::Tensor, 2>, 4> attention;
        for (int slot = 0; slot < 4; ++slot) {
          const LoraFactors* f = adapter.lora(layer, slot);
          ASSERT_NE(f, nullptr);
          attention[slot] = {leaf(f->a, false), leaf(f->b, true)};
        }
        ref.attention.push_back(attention);
        const ExpertLoraFactors* f = adapter.expert_lora(layer);
        ASSERT_NE(f, nullptr);
        ref.experts.push_back({leaf(f->fc1_a, false), leaf(f->fc1_b, true), leaf(f->fc2_a, false), leaf(f->fc2_b, true)});
      }
      const at::Tensor weights = at::randn({11, c.vocab_size}, at::kDouble);
      ForwardOptions options;
      options.grad.fused_wgrad = fused;
      at::Tensor logits = Qwen2Hidden(c, model.weights, &adapter, tokens, options).matmul(w.output_weight().t())[0];
      at::Tensor want = ReferenceLogits(c, stored, tokens[0], &ref);
      EXPECT_LT(MaxAbsDiff(logits.to(at::kDouble), want), 1e-5);
      (logits.to(at::kDouble) * weights).sum().backward();
      (want * weights).sum().backward();
      ASSERT_OK(FoldLocalGradients(&adapter));
      int compared = 0;
      for (size_t layer = 0; layer < w.layers.size(); ++layer) {
        std::vector<std::pair<int, at::Tensor>> pairs;
        for (int slot = 0; slot < 4; ++slot) {
          const LoraFactors* f = adapter.lora(layer, slot);
          pairs.push_back({f->a, ref.attention[layer][slot][0].grad()});
          pairs.push_back({f->b, ref.attention[layer][slot][1].grad()});
        }
        const ExpertLoraFactors* f = adapter.expert_lora(layer);
        int k = 0;
        for (int index : {f->fc1_a, f->fc1_b, f->fc2_a, f->fc2_b}) pairs.push_back({index, ref.experts[layer][k++].grad()});
        for (const auto& [index, g] : pairs) {
          const Parameter& p = adapter.parameters()[index];
          SCOPED_TRACE(p.name);
          ASSERT_TRUE(g.defined());
          EXPECT_GT(g.abs().max().item<double>(), 0);
          EXPECT_LT(RelErr(p.main_grad.to(at::kDouble), g), 1e-5);
          ++compared;
        }
      }
      EXPECT_EQ(compared, 2 * (8 + 4));
    }
  }
}

// Packed rows (windowed layer and sinks included) equal each sequence alone.
TEST(GptOssModelTest, PackedRowsEqualEachSequenceAlone) {
  const ModelConfig c = TinyGptOss();
  ExpectPackedRowsEqualAlone(c, TinyWeights(c, 6), 1e-6);
}

// PEFT's target_parameters form: the keys PEFT writes for gpt-oss's stacked experts, the
// weight delta PEFT computes from them (its einsum, written out here) equal to lorastep's,
// and a round trip.
TEST(GptOssModelTest, PeftTargetParametersForm) {
  const ModelConfig c = TinyGptOss();
  const ModelWeights w = TinyWeights(c, 7);
  const std::string dir = ScratchDir("gpt_oss_peft");
  for (const std::string layout : {"per_expert", "shared_outer"}) {
    SCOPED_TRACE(layout);
    LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 8;
    lc.expert_lora = layout;
    lc.target_modules = {"q_proj", "v_proj", "gate_up_proj", "down_proj"};
    auto make = [&](uint64_t seed) {
      Adapter a = Adapter::CreateLora(c, lc, at::kCPU, at::kFloat, seed).value();
      at::NoGradGuard no_grad;
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed + 100);
      for (Parameter& p : a.parameters()) p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0, 0.1, gen));
      return a;
    };
    Adapter adapter = make(1);
    const PeftExportOptions options = PeftOptionsFor(c, lc, false);
    ASSERT_OK(ExportPeftAdapter(dir + "/" + layout, adapter, "base", nullptr, options));
    ASSERT_OK_AND_ASSIGN(std::string config_text, ReadFileToString(dir + "/" + layout + "/adapter_config.json"));
    EXPECT_NE(config_text.find("\"target_parameters\": [\n    \"mlp.experts.gate_up_proj\",\n    \"mlp.experts.down_proj\""),
              std::string::npos)
        << config_text;
    EXPECT_NE(config_text.find("\"target_modules\": [\n    \"q_proj\",\n    \"v_proj\"\n  ]"), std::string::npos);
    ASSERT_OK_AND_ASSIGN(SafetensorsFile file, SafetensorsFile::Open(dir + "/" + layout + "/adapter_model.safetensors"));
    const std::string l1 = "base_model.model.model.layers.1.mlp.experts.";
    const int64_t e = c.moe.num_experts, r = 4, h = c.hidden_size, f = c.moe.moe_intermediate_size;
    auto tensor = [&](const std::string& key) { return TensorFromEntry(*file.Find(l1 + key).value()).value().to(at::kDouble); };
    at::Tensor a1 = tensor("base_layer.lora_A.weight"), b1 = tensor("base_layer.lora_B.weight");
    at::Tensor a2 = tensor("lora_A.weight"), b2 = tensor("lora_B.weight");
    EXPECT_EQ(a1.sizes(), (at::IntArrayRef{e * r, h}));
    EXPECT_EQ(b1.sizes(), (at::IntArrayRef{2 * f, r * e}));
    EXPECT_EQ(a2.sizes(), (at::IntArrayRef{e * r, f}));
    EXPECT_EQ(b2.sizes(), (at::IntArrayRef{h, r * e}));
    // PEFT: delta[e] = scale * sum_k A[e, k, :]^T B[:, k, e]^T, in the stored [E, in, out] layout.
    auto peft_delta = [&](const at::Tensor& a, const at::Tensor& b) {
      at::Tensor av = a.reshape({e, r, a.size(1)}), bv = b.reshape({b.size(0), r, e});
      std::vector<at::Tensor> out;
      for (int64_t x = 0; x < e; ++x) out.push_back(av[x].t().matmul(bv.select(2, x).t()) * lc.scale());
      return at::stack(out);
    };
    // lorastep: scale * B_e A_e in its layout, then stored as the weights are.
    const ExpertLoraFactors* fl = adapter.expert_lora(1);
    auto value = [&](int index, int64_t x) {
      const at::Tensor& v = adapter.parameters()[index].value;
      return (v.dim() == 2 ? v : v[x]).to(at::kDouble);
    };
    std::vector<at::Tensor> up, down;
    for (int64_t x = 0; x < e; ++x) {
      up.push_back(value(fl->fc1_b, x).reshape({2 * f, r}).matmul(value(fl->fc1_a, x)) * lc.scale());
      down.push_back(value(fl->fc2_b, x).matmul(value(fl->fc2_a, x)) * lc.scale());
    }
    EXPECT_LT(MaxAbsDiff(peft_delta(a1, b1), GptOssToStored(GptOssExpertTensor::kGateUp, at::stack(up))), 1e-12);
    EXPECT_LT(MaxAbsDiff(peft_delta(a2, b2), GptOssToStored(GptOssExpertTensor::kDown, at::stack(down))), 1e-12);
    // Round trip: the same function.
    Adapter back = make(2);
    ASSERT_OK(ImportPeftAdapter(dir + "/" + layout, &back, options));
    at::NoGradGuard no_grad;
    const at::Tensor tokens = at::randint(c.vocab_size, {1, 7}, at::kLong);
    EXPECT_EQ(MaxAbsDiff(Qwen2Hidden(c, w, &back, tokens, ForwardOptions{}), Qwen2Hidden(c, w, &adapter, tokens, ForwardOptions{})),
              0);
  }
  // Read with the per-module form's options (a Qwen MoE run's), the keys are missing: named.
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.target_modules = {"q_proj", "v_proj", "gate_up_proj", "down_proj"};
  Adapter other = Adapter::CreateLora(c, lc, at::kCPU, at::kFloat, 3).value();
  PeftExportOptions modules;
  EXPECT_THAT(ImportPeftAdapter(dir + "/per_expert", &other, modules),
              StatusIs(absl::StatusCode::kInvalidArgument, "target_modules"));
  // A run with down_proj alone on the experts does not take an adapter of both.
  lc.target_modules = {"q_proj", "v_proj", "down_proj"};
  Adapter down_only = Adapter::CreateLora(c, lc, at::kCPU, at::kFloat, 3).value();
  EXPECT_THAT(ImportPeftAdapter(dir + "/per_expert", &down_only, PeftOptionsFor(c, lc, false)),
              StatusIs(absl::StatusCode::kInvalidArgument, "target_parameters"));
}

// The clamped SwiGLU's CUDA kernel (a CUDA test device, a build with lorastep's kernels)
// against the composition written here, each operation storing the input's type as
// transformers computes it: values and gate_up's gradient, with inputs past the limit on
// both sides (the clamps' zero gradients), rows that fill 16-byte packs and rows that do not.
TEST(GptOssModelTest, ClampedSwiGluKernelOnTheTestDeviceMatchesTheComposition) {
  const auto options = at::TensorOptions().device(testing::TestDevice()).dtype(testing::TestDtype());
  const double alpha = 1.702, limit = 7.0, tol = testing::TestDtype() == at::kBFloat16 ? 1e-2 : 1e-6;
  for (int64_t f : {64, 10}) {
    at::manual_seed(12);
    const at::Tensor gate_up0 = (at::randn({5, 7, 2 * f}) * 5).to(options);
    const at::Tensor grad = at::randn({5, 7, f}).to(options);
    auto run = [&](bool reference) {
      const at::Tensor gate_up = gate_up0.clone().requires_grad_(true);
      at::Tensor y;
      if (reference) {
        const at::Tensor gate = gate_up.narrow(-1, 0, f).clamp_max(limit);
        const at::Tensor up = gate_up.narrow(-1, f, f).clamp(-limit, limit);
        y = (up + 1) * (gate * at::sigmoid(gate * alpha));
      } else {
        y = ClampedSwiGluKernel(gate_up, alpha, limit);
        if (!y.defined()) return std::array<at::Tensor, 2>{};
      }
      y.backward(grad);
      return std::array<at::Tensor, 2>{y.detach(), gate_up.grad()};
    };
    const auto got = run(false);
    if (!got[0].defined()) GTEST_SKIP() << "no clamped SwiGLU kernel for this build and device";
    const auto want = run(true);
    EXPECT_LT(RelErr(got[0], want[0]), tol) << f;
    EXPECT_LT(RelErr(got[1], want[1]), tol) << f;
    // The clamps' zeros land where the composition's do.
    EXPECT_TRUE(at::equal(got[1].eq(0), want[1].eq(0))) << f;
  }
}

}  // namespace
}  // namespace lorastep
