// (a) Model logits against a plain reference written here from the Qwen2 definition, and
// Hugging Face folder loading (single file and sharded).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include "lib/io/file_util.h"
#include "lib/model/linear.h"
#include "lib/model/model_weights.h"
#include "lib/model/qwen2.h"
#include "lib/model/rope.h"
#include "lib/torch_compat.h"
#include "lib/training/grad_finalizer.h"
#include "tests/model_test_util.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::RelErr;
using ::lorastep::testing::MaxAbsDiff;
using ::lorastep::testing::PackedSequencesOf;
using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

// Reference decoder in fp64, written independently of lib/: explicit loops over heads,
// explicit causal mask, explicit RoPE pairs. Default RoPE's frequencies are computed here;
// a scaled variant's come from RopeFrequencies (checked on their own in rope_test and
// against transformers on the GPU). A sliding layer's query i sees keys i - window < j <= i
// (transformers' sliding_window_overlay). `lora`, when given, adds a LoRA branch's output to
// a projection: lora(layer, slot, input).
using ReferenceLora = std::function<at::Tensor(int64_t layer, int slot, const at::Tensor& input)>;
at::Tensor ReferenceLogits(const ModelConfig& c, const ModelWeights& w, const at::Tensor& tokens,
                           const ReferenceLora& lora = nullptr) {
  auto f64 = [](const at::Tensor& t) { return t.to(at::kCPU, at::kDouble); };
  const int64_t s = tokens.size(1), nh = c.num_attention_heads, nkv = c.num_key_value_heads,
                d = c.head_dim();
  auto norm = [&](const at::Tensor& x, const at::Tensor& g) {
    return f64(g) * x / at::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps);
  };
  at::Tensor x = f64(w.embed_tokens).index_select(0, tokens[0].to(at::kCPU));  // [s, H]
  // RoPE angles: position p, pair j uses theta^(-2j/d); dims (j, j + d/2) rotate together.
  at::Tensor angle = at::empty({s, d / 2}, at::kDouble);
  const auto [scaled_freq, scale] = RopeFrequencies(c, s);
  for (int64_t p = 0; p < s; ++p)
    for (int64_t j = 0; j < d / 2; ++j)
      angle[p][j] = p * (c.rope.type == "default" ? std::pow(c.rope_theta, -2.0 * j / d) : scaled_freq[j].item<double>());
  auto rope = [&](const at::Tensor& v) {  // v: [s, d]
    at::Tensor a = v.narrow(1, 0, d / 2), b = v.narrow(1, d / 2, d / 2);
    at::Tensor cos = angle.cos() * scale, sin = angle.sin() * scale;
    return at::cat({a * cos - b * sin, b * cos + a * sin}, 1);
  };
  auto bias = [&](const LayerWeights& l, int i) { return l.qkv_bias[i].defined() ? f64(l.qkv_bias[i]) : at::zeros({}, at::kDouble); };
  int64_t layer = 0;
  for (const LayerWeights& l : w.layers) {
    const int64_t window = c.AttentionWindow(layer);
    auto project = [&](const at::Tensor& in, int slot) {
      at::Tensor out = in.matmul(f64(l.linear[slot]).t());
      return lora ? out + lora(layer, slot, in) : out;
    };
    at::Tensor h = norm(x, l.input_norm);
    at::Tensor q = project(h, kQProj) + bias(l, 0);
    at::Tensor k = project(h, kKProj) + bias(l, 1);
    at::Tensor v = project(h, kVProj) + bias(l, 2);
    // Qwen3: RMSNorm over each head's query and key before RoPE.
    auto head_norm = [&](const at::Tensor& t, const at::Tensor& g) { return g.defined() ? norm(t, g) : t; };
    std::vector<at::Tensor> heads;
    for (int64_t hd = 0; hd < nh; ++hd) {
      const int64_t g = hd / (nh / nkv);
      at::Tensor qh = rope(head_norm(q.narrow(1, hd * d, d), l.q_norm));
      at::Tensor kh = rope(head_norm(k.narrow(1, g * d, d), l.k_norm));
      at::Tensor vh = v.narrow(1, g * d, d);
      at::Tensor scores = qh.matmul(kh.t()) / std::sqrt(static_cast<double>(d));
      at::Tensor hidden = at::zeros({s, s}, at::kBool);
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = 0; j < s; ++j) hidden[i][j] = j > i || (window > 0 && j <= i - window);
      heads.push_back(at::softmax(scores.masked_fill(hidden, -INFINITY), 1).matmul(vh));
    }
    x = x + project(at::cat(heads, 1), kOProj);
    h = norm(x, l.post_attention_norm);
    at::Tensor gate = project(h, kGateProj);
    at::Tensor up = project(h, kUpProj);
    x = x + project(gate * at::sigmoid(gate) * up, kDownProj);
    ++layer;
  }
  x = norm(x, w.final_norm);
  return x.matmul(f64(w.output_weight()).t());
}

// Qwen2 (q/k/v biases), Qwen3 (q/k norms, no biases, head_dim given), Llama 3 (llama3 RoPE),
// and Qwen2 with each scaled RoPE, tied and untied.
TEST(ModelTest, LogitsMatchPlainReferenceFp32) {
  std::vector<std::pair<std::string, ModelConfig>> cases;
  for (const char* preset : {"tiny", "tiny-qwen3", "tiny-llama"}) cases.push_back({preset, ModelConfigPreset(preset).value()});
  for (const char* preset : {"tiny", "tiny-qwen3"}) {  // the second layer in a window of 4 (of the 13 tokens)
    ModelConfig c = ModelConfigPreset(preset).value();
    c.sliding_window = 4;
    c.sliding_layers = {false, true};
    cases.push_back({std::string(preset) + " sliding window", c});
  }
  for (const char* type : {"linear", "dynamic", "yarn"}) {
    ModelConfig c = ModelConfigPreset("tiny").value();
    c.rope.type = type;
    c.rope.factor = 4;
    if (c.rope.type == "dynamic") c.max_position_embeddings = 8;  // the test's 13 tokens are past it
    cases.push_back({std::string("tiny rope ") + type, c});
  }
  for (auto& [name, c] : cases) {
    for (bool tied : {true, false}) {
      c.tie_word_embeddings = tied;
      ModelWeights w = RandomModelWeights(c, 7);
      at::Tensor tokens = at::randint(0, c.vocab_size, {1, 13}, at::kLong);
      ForwardOptions options;
      options.training = false;
      at::Tensor hidden = Qwen2Hidden(c, w, nullptr, tokens, options);
      at::Tensor logits = hidden.matmul(w.output_weight().t());
      at::Tensor ref = ReferenceLogits(c, w, tokens);
      EXPECT_LT(MaxAbsDiff(logits[0], ref), 1e-5) << name << " tied=" << tied;
      EXPECT_LT(RelErr(logits[0], ref), 1e-5) << name;
    }
  }
}

// RoPE tables are kept per (theta, head_dim, device, dtype) and grown to the longest
// sequence seen, then cut to each call's length: a short call after a longer one must give
// bitwise what it gave when its table was built at its own length.
TEST(ModelTest, RopeTablesCutFromALongerOneGiveTheSameResult) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.rope_theta = 12345.0;  // a table no other test builds
  const ModelWeights w = RandomModelWeights(c, 7);
  ForwardOptions options;
  options.training = false;
  const at::Tensor short_tokens = at::randint(0, c.vocab_size, {1, 8}, at::kLong);
  const at::Tensor first = Qwen2Hidden(c, w, nullptr, short_tokens, options);
  const at::Tensor long_tokens = at::randint(0, c.vocab_size, {1, 40}, at::kLong);
  const at::Tensor longer = Qwen2Hidden(c, w, nullptr, long_tokens, options);
  EXPECT_EQ(longer.size(1), 40);
  EXPECT_TRUE(at::equal(Qwen2Hidden(c, w, nullptr, short_tokens, options), first));
  ModelConfig other = c;
  other.rope_theta = 54321.0;  // another theta gets its own table
  EXPECT_FALSE(at::equal(Qwen2Hidden(other, w, nullptr, short_tokens, options), first));
}

// LoRA on the LM head (train_unembed) against plain autograd on dense fp64 logits
// h W^T + scale (h A^T) B^T: log-probs, entropies, and the gradients of h, A and B, for
// fused and unfused weight gradients, chunked over fewer tokens than the batch.
TEST(ModelTest, LoraHeadMatchesDenseReference) {
  const ModelConfig c = ModelConfigPreset("tiny").value();
  const ModelWeights w = RandomModelWeights(c, 5);
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.target_modules = {"q_proj", "lm_head"};
  const int64_t t = 11;
  at::Tensor h0 = at::randn({t, c.hidden_size}, at::kFloat);
  at::Tensor targets = at::randint(0, c.vocab_size, {t}, at::kLong);
  at::Tensor g_lp = at::randn({t}, at::kFloat), g_ent = at::randn({t}, at::kFloat);
  for (bool fused : {true, false}) {
    ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3));
    const LoraFactors* f = adapter.head_lora();
    ASSERT_NE(f, nullptr);
    Parameter& a = adapter.parameters()[f->a];
    Parameter& b = adapter.parameters()[f->b];
    EXPECT_EQ(a.name, "base_model.model.lm_head.lora_A.weight");
    EXPECT_EQ(b.name, "base_model.model.lm_head.lora_B.weight");
    ASSERT_EQ(b.value.sizes(), (at::IntArrayRef{c.vocab_size, 4}));
    {
      at::NoGradGuard no_grad;
      b.value.copy_(at::randn_like(b.value) * 0.1);  // B = 0 at creation would hide its term
    }
    ForwardOptions options;
    options.grad.fused_wgrad = fused;
    at::Tensor h = h0.clone().requires_grad_(true);
    TokenScores got = Qwen2HeadScores(w, &adapter, h, targets, /*chunk_tokens=*/4, options, {}, true);
    ((got.logprobs * g_lp).sum() + (got.entropy * g_ent).sum()).backward();
    ASSERT_OK(FoldLocalGradients(&adapter));

    auto f64 = [](const at::Tensor& x) { return x.detach().to(at::kDouble).requires_grad_(true); };
    at::Tensor rh = f64(h0), ra = f64(a.value), rb = f64(b.value);
    at::Tensor logits = rh.matmul(w.output_weight().to(at::kDouble).t()) + 2.0 * rh.matmul(ra.t()).matmul(rb.t());
    at::Tensor logp = at::log_softmax(logits, 1);
    at::Tensor lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1);
    at::Tensor ent = -(logp.exp() * logp).sum(1);
    ((lp * g_lp.to(at::kDouble)).sum() + (ent * g_ent.to(at::kDouble)).sum()).backward();
    const std::string what = fused ? "fused" : "unfused";
    EXPECT_LT(RelErr(got.logprobs, lp.detach()), 1e-5) << what;
    EXPECT_LT(RelErr(got.entropy, ent.detach()), 1e-5) << what;
    EXPECT_LT(RelErr(h.grad(), rh.grad()), 1e-5) << what;
    EXPECT_LT(RelErr(a.main_grad, ra.grad()), 1e-5) << what;
    EXPECT_LT(RelErr(b.main_grad, rb.grad()), 1e-5) << what;
  }
}

// The LM head's LoRA is drawn after every layer's: adding lm_head to the targets leaves
// the decoder layers' factors (the same seed) bitwise unchanged.
TEST(ModelTest, LoraHeadLeavesTheLayersFactorsUnchanged) {
  const ModelConfig c = ModelConfigPreset("tiny").value();
  LoraConfig plain;
  plain.rank = 4;
  LoraConfig with_head = plain;
  with_head.target_modules = {"all-linear", "lm_head"};
  ASSERT_OK_AND_ASSIGN(Adapter x, Adapter::CreateLora(c, plain, at::kCPU, at::kFloat, 3));
  ASSERT_OK_AND_ASSIGN(Adapter y, Adapter::CreateLora(c, with_head, at::kCPU, at::kFloat, 3));
  EXPECT_EQ(x.head_lora(), nullptr);
  ASSERT_NE(y.head_lora(), nullptr);
  ASSERT_EQ(y.parameters().size(), x.parameters().size() + 2);
  for (size_t i = 0; i < x.parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(x.parameters()[i].value, y.parameters()[i].value)) << x.parameters()[i].name;
  }
  EXPECT_THAT(LoraTargetModuleNames(with_head).value(),
              ::testing::ElementsAre("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                     "down_proj", "lm_head"));
}

// Packed q/k/v and gate/up weights (PackProjections: one GEMM per group, LoRA branches
// added into their columns, k without a branch) give the per-projection path's hidden
// states and LoRA gradients, fused and unfused; so do they with gate/up's branches folded
// into its base GEMM (fold_lora_b 1; the MLP widened so that gate/up qualifies), where the
// norm before it leaves the room its fold writes x A^T into and gate/up's spare columns hold
// its B (PackProjections).
TEST(ModelTest, PackedProjectionsMatchSeparateOnes) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.intermediate_size = 96;  // gate/up: 192 columns >= 4 x (32 inputs + 8 ranks)
  const ModelWeights separate = RandomModelWeights(c, 9);
  ModelWeights packed = separate;
  PackProjections(&packed);
  const LayerWeights& l = packed.layers[0];
  ASSERT_TRUE(AdjacentRows({l.linear[kQProj], l.linear[kKProj], l.linear[kVProj]}).defined());
  ASSERT_TRUE(AdjacentRows({l.linear[kGateProj], l.linear[kUpProj]}).defined());
  ASSERT_FALSE(AdjacentRows({separate.layers[0].linear[kQProj], separate.layers[0].linear[kKProj]}).defined());
  EXPECT_TRUE(at::equal(l.linear[kVProj], separate.layers[0].linear[kVProj]));
  EXPECT_TRUE(at::equal(l.linear[kUpProj], separate.layers[0].linear[kUpProj]));
  // gate/up's rows leave spare columns for the fold; q/k/v's do not.
  EXPECT_EQ(SpareColumns(AdjacentRows({l.linear[kGateProj], l.linear[kUpProj]})), kFoldSpareColumns);
  EXPECT_EQ(SpareColumns(l.linear[kQProj]), 0);
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.target_modules = {"q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"};
  const at::Tensor tokens = at::randint(0, c.vocab_size, {2, 9}, at::kLong);
  const at::Tensor g = at::randn({2, 9, c.hidden_size}, at::kFloat);
  for (bool fused : {true, false}) {
    std::vector<Adapter> adapters;
    std::vector<at::Tensor> hidden;
    for (int run = 0; run < 3; ++run) {
      const ModelWeights* w = run == 0 ? &separate : &packed;
      ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3));
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
      {
        at::NoGradGuard no_grad;
        for (Parameter& p : adapter.parameters()) {
          if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0.0, 0.1, gen);
        }
      }
      ForwardOptions options;
      options.grad.fused_wgrad = fused;
      LoraGroupOperandCache operands;
      if (run == 2) options.grad.fold_lora_b = 1, options.lora_operands = &operands;
      at::Tensor h = Qwen2Hidden(c, *w, &adapter, tokens, options);
      if (run == 2) {
        const LoraFactors* gate = adapter.lora(0, kGateProj);
        const LoraFactors* up = adapter.lora(0, kUpProj);
        const auto& p = adapter.parameters();
        const LoraGroupOperandCache::Entry* entry =
            operands.Find(AdjacentRows({l.linear[kGateProj], l.linear[kUpProj]}), {p[gate->a].value, p[up->a].value},
                          {p[gate->b].value, p[up->b].value}, adapter.lora_config().scale(), /*fold=*/true);
        ASSERT_NE(entry, nullptr);
        EXPECT_TRUE(entry->w_cat.storage().is_alias_of(l.linear[kGateProj].storage())) << "folded over the weight's buffer";
      }
      (h * g).sum().backward();
      ASSERT_OK(FoldLocalGradients(&adapter));
      hidden.push_back(h.detach());
      adapters.push_back(std::move(adapter));
    }
    for (int run : {1, 2}) {
      const std::string what = std::string(fused ? "fused" : "unfused") + (run == 2 ? " folded" : "");
      EXPECT_LT(RelErr(hidden[run], hidden[0]), 1e-6) << what;
      for (size_t i = 0; i < adapters[0].parameters().size(); ++i) {
        const Parameter& want = adapters[0].parameters()[i];
        EXPECT_LT(RelErr(adapters[run].parameters()[i].main_grad, want.main_grad), 1e-5) << what << " " << want.name;
      }
    }
  }
}

// Sequences packed back to back (one row, attention within each sequence, RoPE from each
// sequence's own start) give each sequence's hidden states and the LoRA gradients of running
// them one at a time.
// Also with a sliding-window layer: its window restarts with each packed sequence.
class PackedSequencesTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(PackedSequencesTest, MatchOneAtATime) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  if (GetParam() > 0) {
    c.sliding_window = GetParam();
    c.sliding_layers = {false, true};
  }
  ModelWeights w = RandomModelWeights(c, 13);
  PackProjections(&w);
  LoraConfig lora;
  lora.rank = 4;
  lora.target_modules = {"all-linear"};
  const std::vector<int64_t> lengths{5, 9, 3};
  std::vector<at::Tensor> seqs;
  for (int64_t n : lengths) seqs.push_back(at::randint(0, c.vocab_size, {1, n}, at::kLong));
  const at::Tensor g = at::randn({1, 17, c.hidden_size}, at::kFloat);
  std::vector<Adapter> adapters;
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::NoGradGuard no_grad;
    for (Parameter& p : adapter.parameters()) {
      if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0.0, 0.1, gen);
    }
    adapters.push_back(std::move(adapter));
  }
  PackedSequences packed = PackedSequencesOf(lengths);
  ForwardOptions options;
  options.packed = &packed;
  at::Tensor h = Qwen2Hidden(c, w, &adapters[0], at::cat(seqs, 1), options);
  ASSERT_EQ(h.sizes(), (at::IntArrayRef{1, 17, c.hidden_size}));
  (h * g).sum().backward();
  ASSERT_OK(FoldLocalGradients(&adapters[0]));
  int64_t start = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    ForwardOptions alone;
    at::Tensor hi = Qwen2Hidden(c, w, &adapters[1], seqs[i], alone);
    (hi * g.narrow(1, start, lengths[i])).sum().backward();
    EXPECT_LT(RelErr(h.detach().narrow(1, start, lengths[i]), hi.detach()), 1e-6) << "sequence " << i;
    start += lengths[i];
  }
  ASSERT_OK(FoldLocalGradients(&adapters[1]));
  for (size_t i = 0; i < adapters[0].parameters().size(); ++i) {
    const Parameter& want = adapters[1].parameters()[i];
    EXPECT_LT(RelErr(adapters[0].parameters()[i].main_grad, want.main_grad), 1e-5) << want.name;
  }
}

INSTANTIATE_TEST_SUITE_P(FullAndSlidingWindow, PackedSequencesTest, ::testing::Values(0, 4));

// On the device and dtype under test (LORASTEP_TEST_DEVICE / _DTYPE): packed rows with a
// sliding layer against each sequence alone. On CUDA in bf16 the packed rows take the flash
// varlen kernel through its window (the blocks outside it skipped), the sequences alone the
// masked path. In fp32 the two agree to 1e-5; in bf16 both are held against the sequences
// alone in fp32, and the packed side may be at most twice as far from it as the bf16 side
// alone (plus 1e-3): bf16's own rounding, where a window one key off moves the outputs by far
// more.
TEST(ModelTest, PackedSlidingWindowOnTheTestDeviceMatchesEachSequenceAlone) {
  at::manual_seed(17);
  const at::Device dev = ::lorastep::testing::TestDevice();
  const at::ScalarType dtype = ::lorastep::testing::TestDtype();
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.sliding_window = 4;
  c.sliding_layers = {false, true};
  ModelWeights w = RandomModelWeights(c, 13);
  ForEachNamedTensor(w, [&](const std::string&, at::Tensor& t) { t = t.to(dev, dtype); });
  const std::vector<int64_t> lengths{5, 11, 3};
  PackedSequences packed = PackedSequencesOf(lengths, dev);
  const at::Tensor tokens = at::randint(0, c.vocab_size, {1, 19}, at::kLong).to(dev);
  const at::Tensor g = at::randn({1, 19, c.hidden_size}, at::kFloat).to(dev, dtype);
  LoraConfig lora;
  lora.rank = 4;
  lora.target_modules = {"all-linear"};
  std::vector<Adapter> adapters;
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lora, dev, dtype, 3));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::NoGradGuard no_grad;
    for (Parameter& p : adapter.parameters()) {
      if (p.name.find("lora_B") != std::string::npos) {
        p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0.0, 0.1, gen));
      }
    }
    adapters.push_back(std::move(adapter));
  }
  // The fp32 reference: the same weights and adapter values in fp32, the sequences alone.
  ModelWeights w32 = RandomModelWeights(c, 13);
  ForEachNamedTensor(w32, [&](const std::string&, at::Tensor& t) { t = t.to(dev, at::kFloat); });
  ASSERT_OK_AND_ASSIGN(Adapter reference, Adapter::CreateLora(c, lora, dev, at::kFloat, 3));
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < reference.parameters().size(); ++i) {
      reference.parameters()[i].value.copy_(adapters[1].parameters()[i].value);
    }
  }
  ForwardOptions options;
  options.packed = &packed;
  const at::Tensor h = Qwen2Hidden(c, w, &adapters[0], tokens, options);
  (h * g).sum().backward();
  ASSERT_OK(FoldLocalGradients(&adapters[0]));
  const bool fp32 = dtype == at::kFloat;
  // got (packed) against alone, or in bf16 against the fp32 reference by alone's distance.
  auto expect_close = [&](const at::Tensor& got, const at::Tensor& alone, const at::Tensor& exact,
                          const std::string& what) {
    if (fp32) {
      EXPECT_LT(RelErr(got, alone), 1e-5) << what;
    } else {
      EXPECT_LE(RelErr(got, exact), 2 * RelErr(alone, exact) + 1e-3) << what;
    }
  };
  int64_t start = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const at::Tensor seq = tokens.narrow(1, start, lengths[i]), gi = g.narrow(1, start, lengths[i]);
    const at::Tensor hi = Qwen2Hidden(c, w, &adapters[1], seq, ForwardOptions());
    (hi * gi).sum().backward();
    const at::Tensor hr = Qwen2Hidden(c, w32, &reference, seq, ForwardOptions());
    (hr * gi.to(at::kFloat)).sum().backward();
    expect_close(h.detach().narrow(1, start, lengths[i]).to(at::kFloat), hi.detach().to(at::kFloat), hr.detach(),
                 "sequence " + std::to_string(i));
    start += lengths[i];
  }
  ASSERT_OK(FoldLocalGradients(&adapters[1]));
  ASSERT_OK(FoldLocalGradients(&reference));
  for (size_t i = 0; i < adapters[0].parameters().size(); ++i) {
    const Parameter& alone = adapters[1].parameters()[i];
    expect_close(adapters[0].parameters()[i].main_grad, alone.main_grad, reference.parameters()[i].main_grad,
                 alone.name);
  }
}

// A sliding-window layer's log-probs and LoRA gradients (q, v and down projections) against
// the fp64 reference above with the same LoRA branches, differentiated by autograd.
TEST(ModelTest, SlidingWindowLogprobsAndLoraGradientsMatchPlainReference) {
  for (const char* preset : {"tiny", "tiny-qwen3"}) {
    ModelConfig c = ModelConfigPreset(preset).value();
    c.sliding_window = 5;
    c.sliding_layers = {true, false};
    const ModelWeights w = RandomModelWeights(c, 9);
    LoraConfig lora;
    lora.rank = 4;
    lora.alpha = 8;
    lora.target_modules = {"q_proj", "v_proj", "down_proj"};
    ASSERT_OK_AND_ASSIGN(Adapter adapter, Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3));
    {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
      at::NoGradGuard no_grad;
      for (Parameter& p : adapter.parameters()) {
        if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0.0, 0.1, gen);
      }
    }
    const at::Tensor tokens = at::randint(0, c.vocab_size, {1, 14}, at::kLong);
    const at::Tensor targets = at::randint(0, c.vocab_size, {14}, at::kLong);
    const at::Tensor g = at::randn({14}, at::kDouble);
    ForwardOptions options;
    const at::Tensor hidden = Qwen2Hidden(c, w, &adapter, tokens, options)[0];
    const at::Tensor lp = at::log_softmax(hidden.matmul(w.output_weight().t()), 1).gather(1, targets.unsqueeze(1)).squeeze(1);
    (lp.to(at::kDouble) * g).sum().backward();
    ASSERT_OK(FoldLocalGradients(&adapter));

    // The reference's factors: fp64 copies that autograd differentiates.
    std::map<std::pair<int64_t, int>, std::pair<at::Tensor, at::Tensor>> factors;
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
      for (int slot : {kQProj, kVProj, kDownProj}) {
        const LoraFactors* f = adapter.lora(layer, slot);
        ASSERT_NE(f, nullptr);
        factors[{layer, slot}] = {adapter.parameters()[f->a].value.detach().to(at::kDouble).requires_grad_(true),
                                  adapter.parameters()[f->b].value.detach().to(at::kDouble).requires_grad_(true)};
      }
    }
    const ReferenceLora branch = [&](int64_t layer, int slot, const at::Tensor& in) {
      auto it = factors.find({layer, slot});
      if (it == factors.end()) return at::zeros({}, at::kDouble);
      return in.matmul(it->second.first.t()).matmul(it->second.second.t()) * lora.scale();
    };
    const at::Tensor ref_lp =
        at::log_softmax(ReferenceLogits(c, w, tokens, branch), 1).gather(1, targets.unsqueeze(1)).squeeze(1);
    (ref_lp * g).sum().backward();
    EXPECT_LT(MaxAbsDiff(lp, ref_lp.detach()), 1e-5) << preset;
    for (const auto& [key, ab] : factors) {
      const LoraFactors* f = adapter.lora(key.first, key.second);
      EXPECT_LT(RelErr(adapter.parameters()[f->a].main_grad, ab.first.grad()), 1e-5)
          << preset << " layer " << key.first << " slot " << key.second << " A";
      EXPECT_LT(RelErr(adapter.parameters()[f->b].main_grad, ab.second.grad()), 1e-5)
          << preset << " layer " << key.first << " slot " << key.second << " B";
    }
  }
}

// Several runs over one packed row (ForwardOptions::run_segments, issue 30's co-scheduling):
// runs that differ in rank, alpha, target modules and dropout, each on its own rows, get the
// hidden states and LoRA gradients each gets alone (its own sequences packed, its own
// dropout stream), and a run's gradients land in its own buffers only. A row the segments do
// not cover is refused. With a dropout run, q/k/v run projection by projection (the dropout
// run has branches there) and gate/up packed; without, both groups run packed, q/k/v with a
// run whose branches skip k (parts with a gap).
class RunSegmentsTest : public ::testing::TestWithParam<double> {};

TEST_P(RunSegmentsTest, GiveEachRunsSoloResults) {
  const ModelConfig c = ModelConfigPreset("tiny").value();
  ModelWeights w = RandomModelWeights(c, 17);
  PackProjections(&w);
  struct Run {
    int64_t rank;
    double alpha, dropout;
    std::vector<std::string> targets;
    std::vector<int64_t> lengths;
  };
  const std::vector<Run> runs{{4, 8, 0.0, {"all-linear"}, {5, 7}},
                              {2, 4, GetParam(), {"q_proj", "v_proj", "down_proj"}, {6}},
                              {8, 8, 0.0, {"o_proj", "gate_proj", "up_proj"}, {3, 4}}};
  auto make_adapter = [&](const Run& r) {
    LoraConfig lora;
    lora.rank = r.rank, lora.alpha = r.alpha, lora.dropout = r.dropout, lora.target_modules = r.targets;
    Adapter adapter = Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3).value();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
    at::NoGradGuard no_grad;
    for (Parameter& p : adapter.parameters()) {
      if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0.0, 0.1, gen);
    }
    return adapter;
  };
  std::vector<at::Tensor> tokens, upstream;
  std::vector<int64_t> all_lengths;
  for (const Run& r : runs) {
    int64_t n = 0;
    for (int64_t len : r.lengths) n += len, all_lengths.push_back(len);
    tokens.push_back(at::randint(0, c.vocab_size, {1, n}, at::kLong));
    upstream.push_back(at::randn({1, n, c.hidden_size}, at::kFloat));
  }
  // Alone: each run's own sequences packed, its own dropout stream.
  std::vector<Adapter> solo;
  std::vector<at::Tensor> solo_hidden;
  for (size_t r = 0; r < runs.size(); ++r) {
    solo.push_back(make_adapter(runs[r]));
    const PackedSequences packed = PackedSequencesOf(runs[r].lengths);
    at::Generator dropout = at::make_generator<at::CPUGeneratorImpl>(100 + r);
    ForwardOptions options;
    options.packed = &packed;
    options.dropout_generator = &dropout;
    at::Tensor h = Qwen2Hidden(c, w, &solo.back(), tokens[r], options);
    (h * upstream[r]).sum().backward();
    ASSERT_OK(FoldLocalGradients(&solo.back()));
    solo_hidden.push_back(h.detach());
  }
  // Together: one packed row, one segment per run.
  std::vector<Adapter> joint;
  std::vector<at::Generator> streams;
  for (size_t r = 0; r < runs.size(); ++r) {
    joint.push_back(make_adapter(runs[r]));
    streams.push_back(at::make_generator<at::CPUGeneratorImpl>(100 + r));
  }
  std::vector<RunSegment> segments;
  int64_t begin = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    segments.push_back({&joint[r], begin, begin + tokens[r].size(1), &streams[r]});
    begin += tokens[r].size(1);
  }
  const PackedSequences packed = PackedSequencesOf(all_lengths);
  ForwardOptions options;
  options.packed = &packed;
  options.run_segments = &segments;
  at::Tensor h = Qwen2Hidden(c, w, nullptr, at::cat(tokens, 1), options);
  (h * at::cat(upstream, 1)).sum().backward();
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::string what = "run " + std::to_string(r);
    ASSERT_OK(FoldLocalGradients(&joint[r]));
    EXPECT_LT(RelErr(h.detach().narrow(1, segments[r].begin, tokens[r].size(1)), solo_hidden[r]), 1e-6) << what;
    ASSERT_EQ(joint[r].parameters().size(), solo[r].parameters().size());
    for (size_t i = 0; i < solo[r].parameters().size(); ++i) {
      const Parameter& want = solo[r].parameters()[i];
      EXPECT_GT(want.main_grad.abs().max().item<double>(), 0) << what << " " << want.name;
      EXPECT_LT(RelErr(joint[r].parameters()[i].main_grad, want.main_grad), 1e-5) << what << " " << want.name;
    }
  }
  std::vector<RunSegment> short_segments{{&joint[0], 0, 5, nullptr}};
  options.run_segments = &short_segments;
  EXPECT_THROW(Qwen2Hidden(c, w, nullptr, at::cat(tokens, 1), options), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(ModelTest, RunSegmentsTest, ::testing::Values(0.2, 0.0));

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

// How many autograd nodes named `name` the graph behind `t` holds.
int CountNodes(const at::Tensor& t, const std::string& name) {
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    if (n->name() == name) ++count;
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return count;
}

// Activation recomputation (ForwardOptions::recompute_layers), full and selective, gives the
// hidden states and every gradient of the plain forward: dense and MoE layers, LoRA fused and
// unfused, LoRA dropout (the replay draws the same masks and leaves the generator where the
// plain run leaves it), packed sequences, and full fine-tuning. Each layer is one recomputed
// node. On the device and dtype under test (the CUDA run covers the fused kernels' replay and,
// packed in bf16, selective's kept flash-attention statistics).
TEST(ModelTest, RecomputedLayersGiveThePlainForwardsResults) {
  struct Case {
    const char* preset;
    bool fused, packed, full;
    double dropout;
    bool sliding = false;  // the second layer in a window of 4
  };
  for (const Case& k : {Case{"tiny", true, false, false, 0.0}, Case{"tiny", false, false, false, 0.0},
                        Case{"tiny", true, true, false, 0.0}, Case{"tiny", true, false, false, 0.2},
                        Case{"tiny", true, false, true, 0.0}, Case{"tiny-moe", true, true, false, 0.0},
                        Case{"tiny", true, true, false, 0.0, true}, Case{"tiny", true, false, false, 0.0, true},
                        Case{"tiny", true, true, true, 0.0, true}, Case{"tiny-gpt-oss", true, true, false, 0.0},
                        Case{"tiny-qwen3.5", true, true, false, 0.0}, Case{"tiny-qwen3.5", true, false, true, 0.0}}) {
    const std::string what = std::string(k.preset) + (k.fused ? " fused" : " unfused") + (k.packed ? " packed" : "") +
                             (k.full ? " full" : "") + (k.dropout > 0 ? " dropout" : "") +
                             (k.sliding ? " sliding window" : "");
    ModelConfig c = ModelConfigPreset(k.preset).value();
    if (k.sliding) {
      c.sliding_window = 4;
      c.sliding_layers = {false, true};
    }
    const at::Device dev = ::lorastep::testing::TestDevice();
    const at::ScalarType dtype = ::lorastep::testing::TestDtype();
    ModelWeights w = RandomModelWeights(c, 21);
    ForEachNamedTensor(w, [&](const std::string&, at::Tensor& t) { t = t.to(dev, dtype); });
    PackProjections(&w);
    PackedSequences packed = PackedSequencesOf({6, 9, 4}, dev);
    const at::Tensor tokens = (k.packed ? at::randint(0, c.vocab_size, {1, 19}, at::kLong)
                                        : at::randint(0, c.vocab_size, {2, 9}, at::kLong))
                                  .to(dev);
    const at::Tensor g = at::randn({tokens.size(0), tokens.size(1), c.hidden_size}, at::kFloat).to(dev, dtype);
    std::vector<Adapter> adapters;
    std::vector<at::Tensor> hidden, next_draw;
    for (const LayerRecompute recompute : {LayerRecompute::kNone, LayerRecompute::kFull, LayerRecompute::kSelective}) {
      LoraConfig lora;
      lora.rank = 4;
      lora.dropout = k.dropout;
      lora.target_modules = {"all-linear"};
      absl::StatusOr<Adapter> made = k.full ? absl::StatusOr<Adapter>(Adapter::CreateFullFinetune(w))
                                            : Adapter::CreateLora(c, lora, dev, dtype, 3);
      ASSERT_OK(made.status());
      Adapter adapter = *std::move(made);
      {
        at::Generator init = at::make_generator<at::CPUGeneratorImpl>(5);
        at::NoGradGuard no_grad;
        for (Parameter& p : adapter.parameters()) {
          if (p.name.find("lora_B") != std::string::npos) {
            p.value.copy_(at::empty(p.value.sizes(), at::kFloat).normal_(0.0, 0.1, init));
          }
        }
      }
      at::Generator dropout = at::make_generator<at::CPUGeneratorImpl>(17);
      ForwardOptions options;
      options.grad.fused_wgrad = k.fused;
      options.dropout_generator = &dropout;
      options.packed = k.packed ? &packed : nullptr;
      options.recompute_layers = recompute;
      at::Tensor h = Qwen2Hidden(c, w, &adapter, tokens, options);
      EXPECT_EQ(CountNodes(h, "lorastep::RecomputedLayerNode"),
                recompute != LayerRecompute::kNone ? c.num_hidden_layers : 0)
          << what;
      (h * g).sum().backward();
      ASSERT_OK(FoldLocalGradients(&adapter));
      hidden.push_back(h.detach());
      next_draw.push_back(at::rand({4}, dropout));
      adapters.push_back(std::move(adapter));
    }
    for (size_t run = 1; run < adapters.size(); ++run) {
      const std::string how = what + (run == 1 ? " full" : " selective");
      EXPECT_LT(RelErr(hidden[run], hidden[0]), ::lorastep::testing::Tol(1e-6)) << how;
      EXPECT_TRUE(at::equal(next_draw[run], next_draw[0])) << how;
      for (size_t i = 0; i < adapters[0].parameters().size(); ++i) {
        const Parameter& want = adapters[0].parameters()[i];
        const at::Tensor& got = adapters[run].parameters()[i].main_grad;
        if (want.main_grad.abs().max().item<double>() == 0) continue;  // e.g. an unused expert's
        // fp32 on CUDA: the replay's reductions may run in another order (1.06e-6 seen).
        EXPECT_LT(RelErr(got, want.main_grad), ::lorastep::testing::Tol(dev.is_cuda() ? 1e-5 : 1e-6))
            << how << " " << want.name;
      }
    }
  }
}

// cuDNN's attention kept for selective recomputation (compat::CudnnCausalAttentionSaved and its
// backward) gives SDPA's output and input gradients, grouped K/V heads read in place, with q/k/v
// laid out as the decoder layer hands them over ([b, s, heads, d] memory). On the H200 in bf16
// at head dim 128 SDPA picks cuDNN, so the kept path is what the long-sequence runs take;
// elsewhere SDPA does not pick it and the layer replays attention instead.
TEST(ModelTest, KeptCudnnAttentionGivesSdpasOutputAndGradients) {
  const at::Device dev = ::lorastep::testing::TestDevice();
  const at::ScalarType dtype = ::lorastep::testing::TestDtype();
  const int64_t b = 2, s = 96, heads = 8, kv = 2, d = 128;
  at::manual_seed(3);
  const auto opts = at::TensorOptions().device(dev).dtype(dtype);
  const at::Tensor q = at::randn({b, s, heads, d}, opts).transpose(1, 2);
  const at::Tensor k = at::randn({b, s, kv, d}, opts).transpose(1, 2);
  const at::Tensor v = at::randn({b, s, kv, d}, opts).transpose(1, 2);
  const at::Tensor g = at::randn({b, s, heads, d}, opts).transpose(1, 2);
  const bool cudnn = compat::UsesCudnnAttention(q, k, v);
  if (!dev.is_cuda()) {
    EXPECT_FALSE(cudnn);
    return;
  }
  if (dtype == at::kBFloat16) {
    EXPECT_TRUE(cudnn) << "SDPA no longer picks cuDNN at head dim 128 in bf16";
  }
  if (!cudnn) return;
  torch::autograd::variable_list inputs;
  for (const at::Tensor& t : {q, k, v}) inputs.push_back(t.detach().requires_grad_(true));
  const at::Tensor want = compat::CausalAttention(inputs[0], inputs[1], inputs[2]);
  const torch::autograd::variable_list want_grads = torch::autograd::grad({want}, inputs, {g});
  compat::CudnnAttentionSaved saved;
  {
    at::NoGradGuard no_grad;
    saved = compat::CudnnCausalAttentionSaved(q, k, v);
  }
  EXPECT_TRUE(at::equal(saved.out, want.detach()));
  // The backward accumulates dq in any order (atomics): equal to a rounding of bf16.
  const double tol = 5e-3;
  auto [dq, dk, dv] = compat::CudnnCausalAttentionBackward(g, q, k, v, saved);
  EXPECT_LT(RelErr(dq, want_grads[0]), tol);
  EXPECT_LT(RelErr(dk, want_grads[1]), tol);
  EXPECT_LT(RelErr(dv, want_grads[2]), tol);
  // A gradient in another layout than the output's is read by value.
  auto [dq2, dk2, dv2] = compat::CudnnCausalAttentionBackward(g.contiguous(), q, k, v, saved);
  EXPECT_LT(RelErr(dq2, want_grads[0]), tol);
  EXPECT_LT(RelErr(dv2, want_grads[2]), tol);
}

}  // namespace
}  // namespace lorastep
