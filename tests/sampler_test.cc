// The sampler on CPU in fp32 against plain references written here: greedy decoding equals an
// argmax decode that runs the whole sequence through the model at every step (no cache); the
// reported log-probs equal the trainer's scores of the returned sequence; seeds, prefix
// sharing, batching with other requests and chunked prefill change nothing; truncation keeps
// only its set and temperature sampling follows the softmax; bad requests and the cache
// budget are refused naming the field, and cancelled requests free their blocks.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/model/adapter.h"
#include "lib/model/qwen2.h"
#include "lib/sampling/kv_blocks.h"
#include "lib/sampling/sampler.h"
#include "lib/sampling/sampling_params.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"
#include "tools/random_lora.h"

namespace lorastep {
namespace {

using ::testing::HasSubstr;
using ::lorastep::testing::StatusIs;

// The tiny preset with its second layer attending in a window of 3 positions.
ModelConfig TinySlidingWindow() {
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.sliding_window = 3;
  c.sliding_layers = {false, true};
  return c;
}

struct Fixture {
  Fixture() : Fixture(ModelConfigPreset("tiny").value()) {}
  explicit Fixture(ModelConfig c) : config(std::move(c)) {}
  ModelConfig config;
  ModelWeights weights = RandomModelWeights(config, 11);
  Adapter adapter = MakeAdapter(3);
  Adapter other = MakeAdapter(4);

  Adapter MakeAdapter(uint64_t seed) const {
    LoraConfig lora;
    lora.rank = 4;
    lora.alpha = 8;
    lora.target_modules = {"all-linear", "lm_head"};
    Adapter a = Adapter::CreateLora(config, lora, at::kCPU, at::kFloat, seed).value();
    DrawLoraFactors(a, seed, 0.2);
    return a;
  }
  KvBlockPool Pool(int64_t blocks, int64_t block_size = 4) const {
    KvShape shape = KvShapeFor(config, 0, config.num_hidden_layers, config.num_key_value_heads);
    shape.block_size = block_size;
    return KvBlockPool::Create(shape, blocks, at::kFloat, at::kCPU).value();
  }
};

// The model's fp32 logits at every position of `tokens`, the whole sequence at once, no cache.
at::Tensor PlainLogits(const Fixture& f, const Adapter* adapter, const std::vector<int64_t>& tokens) {
  at::NoGradGuard no_grad;
  ForwardOptions options;
  options.training = false;
  const at::Tensor h = Qwen2Hidden(f.config, f.weights, adapter, at::tensor(tokens, at::kLong).unsqueeze(0), options)[0];
  at::Tensor logits = at::mm(h, f.weights.output_weight().t());
  if (adapter != nullptr && adapter->head_lora() != nullptr) {
    const auto& ps = adapter->parameters();
    logits += at::mm(at::mm(h, ps[adapter->head_lora()->a].value.t()), ps[adapter->head_lora()->b].value.t()) *
              adapter->lora_config().scale();
  }
  return logits;
}

// Runs `requests` (adapter, request) through one engine to the end; results in order.
std::vector<SampleResult> RunAll(const Fixture& f, KvBlockPool* pool,
                                 const std::vector<std::pair<const Adapter*, SampleRequest>>& requests,
                                 SamplerOptions options = {}) {
  SamplerEngine engine(f.config, f.weights, pool, options);
  std::vector<int64_t> ids;
  for (const auto& [adapter, request] : requests) ids.push_back(engine.Add(adapter, request).value());
  for (int steps = 0; !engine.Idle() && steps < 10000; ++steps) EXPECT_TRUE(engine.Step().ok());
  std::vector<SampleResult> out;
  for (int64_t id : ids) {
    std::optional<SampleResult> r = engine.Take(id);
    EXPECT_TRUE(r.has_value());
    out.push_back(r.has_value() ? *r : SampleResult());
  }
  return out;
}

SampleRequest Request(std::vector<int64_t> prompt, int64_t max_tokens, double temperature, uint64_t seed,
                      int64_t num_samples = 1) {
  SampleRequest r;
  r.prompt = std::move(prompt);
  r.num_samples = num_samples;
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  return r;
}

// Also with a sliding-window layer: the cached attention's window (prompt chunks and decode)
// against the uncached forward's; gpt-oss (sinks in the cached softmax, its MoE); Qwen3.5 (the
// Gated DeltaNet layers' convolution history and rule state carried per sequence).
TEST(SamplerTest, GreedyEqualsAnArgmaxDecodeWithoutACache) {
  for (const std::string family : {"tiny", "sliding", "tiny-gpt-oss", "tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    Fixture f = family == "sliding" ? Fixture(TinySlidingWindow()) : Fixture(ModelConfigPreset(family).value());
    for (LayerWeights& l : f.weights.layers) {
      if (l.sinks.defined()) l.sinks = at::randn(l.sinks.sizes()) * 2;  // sinks of a visible size
    }
    KvBlockPool pool = f.Pool(64);
    const std::vector<int64_t> prompt = {5, 17, 3, 42, 9, 11, 60};  // 7 tokens: a partial block of 4
    for (const Adapter* adapter : std::vector<const Adapter*>{nullptr, &f.adapter}) {
      SCOPED_TRACE(std::string(adapter == nullptr ? "base" : "lora") + ", " + family);
      const SampleResult got = RunAll(f, &pool, {{adapter, Request(prompt, 12, 0.0, 1)}})[0];
      ASSERT_EQ(got.sequences.size(), 1u);
      const SampledSequence& s = got.sequences[0];
      std::vector<int64_t> seq = prompt;
      for (int step = 0; step < 12; ++step) {
        const at::Tensor logits = PlainLogits(f, adapter, seq)[-1];
        const int64_t want = logits.argmax().item<int64_t>();
        ASSERT_EQ(s.tokens[step], want) << "step " << step;
        EXPECT_NEAR(s.logprobs[step], at::log_softmax(logits, 0)[want].item<float>(), 1e-5) << "step " << step;
        EXPECT_EQ(s.sampling_logprobs[step], 0.0f);  // greedy: probability 1
        seq.push_back(want);
      }
      EXPECT_EQ(s.stop_reason, "length");
    }
    EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
  }
}

// Every sampled token's model log-prob is what the trainer computes on the returned sequence
// (Qwen2HeadScores after the forward); at temperature 1 with nothing cut, the sampling
// distribution is the model's.
TEST(SamplerTest, ReportedLogProbsAreTheTrainersScoresOfTheReturnedSequence) {
  Fixture f;
  KvBlockPool pool = f.Pool(64);
  const std::vector<int64_t> prompt = {1, 2, 3, 4, 5};
  SampleRequest r = Request(prompt, 10, 1.0, 7, 3);
  r.params.prompt_logprobs = true;
  r.params.prompt_top_logprobs = 5;
  const SampleResult got = RunAll(f, &pool, {{&f.adapter, r}})[0];
  ASSERT_EQ(got.sequences.size(), 3u);
  // Each prompt position's 5 most likely tokens: the plain forward's top 5, in order.
  ASSERT_EQ(got.prompt_top_logprobs.size(), prompt.size() - 1);
  const at::Tensor plain = at::log_softmax(PlainLogits(f, &f.adapter, prompt), -1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    auto [values, ids] = plain[static_cast<int64_t>(i)].topk(5);
    ASSERT_EQ(got.prompt_top_logprobs[i].size(), 5u);
    for (int64_t j = 0; j < 5; ++j) {
      EXPECT_EQ(got.prompt_top_logprobs[i][j].token, ids[j].item<int64_t>()) << "prompt " << i << " rank " << j;
      EXPECT_NEAR(got.prompt_top_logprobs[i][j].logprob, values[j].item<float>(), 1e-5) << "prompt " << i;
    }
  }
  for (const SampledSequence& s : got.sequences) {
    std::vector<int64_t> seq = prompt;
    seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
    at::NoGradGuard no_grad;
    ForwardOptions options;
    options.training = false;
    const at::Tensor input = at::tensor(std::vector<int64_t>(seq.begin(), seq.end() - 1), at::kLong);
    const at::Tensor hidden = Qwen2Hidden(f.config, f.weights, &f.adapter, input.unsqueeze(0), options)[0];
    const at::Tensor targets = at::tensor(std::vector<int64_t>(seq.begin() + 1, seq.end()), at::kLong);
    const TokenScores scores = Qwen2HeadScores(f.weights, &f.adapter, hidden, targets, 64, options, {}, false);
    const int64_t p = static_cast<int64_t>(prompt.size());
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      EXPECT_NEAR(s.logprobs[i], scores.logprobs[p - 1 + i].item<float>(), 1e-5) << i;
      EXPECT_NEAR(s.sampling_logprobs[i], s.logprobs[i], 1e-5) << i;
    }
    ASSERT_EQ(got.prompt_logprobs.size(), prompt.size() - 1);
    for (int64_t i = 0; i + 1 < p; ++i) {
      EXPECT_NEAR(got.prompt_logprobs[i], scores.logprobs[i].item<float>(), 1e-5) << "prompt " << i;
    }
  }
}

// The same seed and request give the same tokens; sample i of an 8-sample request (its prompt
// prefilled once) equals a one-sample request with seed + i; batched with two other requests
// (another adapter, the base model) and through a small step budget (chunked prefill), a
// request's samples are what they are alone. Qwen3.5 too: its samples fork the prompt's
// recurrent states, and chunked prefill continues them.
TEST(SamplerTest, SeedsPrefixSharingBatchingAndChunksChangeNothing) {
  for (const std::string family : {"tiny", "tiny-qwen3.5"}) {
  SCOPED_TRACE(family);
  Fixture f(ModelConfigPreset(family).value());
  KvBlockPool pool = f.Pool(256);
  // A prompt prefilled in other pieces runs the Gated DeltaNet rule over other chunks: the
  // same numbers to fp32 rounding (about 1e-6 in a log-prob), not bitwise.
  const double same = family == "tiny" ? 1e-6 : 1e-5;
  const std::vector<int64_t> prompt = {7, 7, 1, 30, 2, 90, 4, 4, 8};
  SampleRequest shared = Request(prompt, 9, 0.9, 100, 8);
  shared.params.top_k = 20;
  const SampleResult alone = RunAll(f, &pool, {{&f.adapter, shared}})[0];
  const SampleResult again = RunAll(f, &pool, {{&f.adapter, shared}})[0];
  ASSERT_EQ(alone.sequences.size(), 8u);
  EXPECT_EQ(alone.prefill_tokens, static_cast<int64_t>(prompt.size()));
  std::set<std::vector<int64_t>> distinct;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(alone.sequences[i].tokens, again.sequences[i].tokens) << i;
    distinct.insert(alone.sequences[i].tokens);
    SampleRequest one = shared;
    one.num_samples = 1;
    one.params.seed = 100 + i;
    const SampleResult separate = RunAll(f, &pool, {{&f.adapter, one}})[0];
    EXPECT_EQ(separate.sequences[0].tokens, alone.sequences[i].tokens) << i;
    for (size_t t = 0; t < alone.sequences[i].logprobs.size(); ++t) {
      EXPECT_NEAR(separate.sequences[0].logprobs[t], alone.sequences[i].logprobs[t], same) << i << " " << t;
    }
  }
  EXPECT_GT(distinct.size(), 1u) << "eight samples at temperature 0.9 all alike";
  SamplerOptions chunked;
  chunked.max_tokens_per_step = 3;
  const std::vector<SampleResult> batched =
      RunAll(f, &pool,
             {{&f.other, Request({3, 1, 4, 1, 5, 9, 2, 6}, 6, 1.0, 5, 2)},
              {&f.adapter, shared},
              {nullptr, Request({2, 7, 1, 8}, 11, 0.7, 9)}},
             chunked);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(batched[1].sequences[i].tokens, alone.sequences[i].tokens) << i;
    for (size_t t = 0; t < alone.sequences[i].logprobs.size(); ++t) {
      EXPECT_NEAR(batched[1].sequences[i].logprobs[t], alone.sequences[i].logprobs[t], same) << i << " " << t;
    }
  }
  EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
  }
}

TEST(SamplerTest, StopTokensAndSequencesEndASampleWithTheirTokens) {
  Fixture f;
  KvBlockPool pool = f.Pool(64);
  const std::vector<int64_t> prompt = {4, 8, 15, 16, 23, 42};
  const SampledSequence free_run = RunAll(f, &pool, {{&f.adapter, Request(prompt, 10, 0.0, 1)}})[0].sequences[0];
  SampleRequest by_token = Request(prompt, 10, 0.0, 1);
  by_token.params.stop_token_ids = {free_run.tokens[3]};
  const SampledSequence stopped = RunAll(f, &pool, {{&f.adapter, by_token}})[0].sequences[0];
  const auto first = std::find(free_run.tokens.begin(), free_run.tokens.end(), free_run.tokens[3]);
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(free_run.tokens.begin(), first + 1));
  EXPECT_EQ(stopped.stop_reason, "stop");
  SampleRequest by_sequence = Request(prompt, 10, 0.0, 1);
  by_sequence.params.stop_sequences = {{free_run.tokens[4], free_run.tokens[5]}};
  const SampledSequence cut = RunAll(f, &pool, {{&f.adapter, by_sequence}})[0].sequences[0];
  EXPECT_EQ(cut.stop_reason, "stop");
  ASSERT_GE(cut.tokens.size(), 2u);
  EXPECT_EQ(cut.tokens[cut.tokens.size() - 2], free_run.tokens[4]);
  EXPECT_EQ(cut.tokens.back(), free_run.tokens[5]);
}

// Over many draws, top-k, top-p and min-p never give a token outside the set they keep, and
// temperature sampling's frequencies match softmax(logits / T) within five standard errors.
TEST(SamplerTest, TruncationKeepsItsSetAndTemperatureFollowsTheSoftmax) {
  const at::Tensor logits = at::tensor({2.0f, 1.5f, 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, -3.0f});
  auto kept = [&](const SamplingParams& p) {
    std::set<int64_t> out;
    const at::Tensor lp = SamplingLogProbs(logits, p);
    for (int64_t i = 0; i < lp.size(0); ++i) {
      if (std::isfinite(lp[i].item<float>())) out.insert(i);
    }
    return out;
  };
  SamplingParams top_k;
  top_k.top_k = 3;
  EXPECT_EQ(kept(top_k), (std::set<int64_t>{0, 1, 2}));
  SamplingParams top_p;
  top_p.top_p = 0.6;  // softmax: 0.39, 0.24, 0.14, ...: the first two reach 0.6
  EXPECT_EQ(kept(top_p), (std::set<int64_t>{0, 1}));
  SamplingParams min_p;
  min_p.min_p = 0.3;  // at least 0.3 x 0.39: tokens 0, 1, 2
  EXPECT_EQ(kept(min_p), (std::set<int64_t>{0, 1, 2}));
  for (const SamplingParams& p : {top_k, top_p, min_p}) {
    const std::set<int64_t> allowed = kept(p);
    const at::Tensor lp = SamplingLogProbs(logits, p);
    SampleStream stream(3);
    for (int i = 0; i < 5000; ++i) EXPECT_TRUE(allowed.count(DrawToken(lp, stream.Uniform())));
  }
  SamplingParams warm;
  warm.temperature = 1.7;
  const at::Tensor probs = at::softmax(logits / 1.7, 0);
  const at::Tensor lp = SamplingLogProbs(logits, warm);
  EXPECT_TRUE(at::allclose(lp.exp(), probs, 1e-6, 1e-7));
  const int n = 40000;
  std::vector<int> counts(8, 0);
  SampleStream stream(12345);
  for (int i = 0; i < n; ++i) ++counts[DrawToken(lp, stream.Uniform())];
  for (int64_t t = 0; t < 8; ++t) {
    const double p = probs[t].item<double>();
    EXPECT_NEAR(counts[t] / static_cast<double>(n), p, 5 * std::sqrt(p * (1 - p) / n)) << "token " << t;
  }
}

TEST(SamplerTest, BadRequestsAreRefusedNamingTheFieldAndNothingIsQueued) {
  Fixture f;
  KvBlockPool pool = f.Pool(64);
  SamplerEngine engine(f.config, f.weights, &pool, {});
  auto refused = [&](SampleRequest r, const std::string& field) {
    absl::StatusOr<int64_t> id = engine.Add(&f.adapter, std::move(r));
    EXPECT_TRUE(absl::IsInvalidArgument(id.status())) << field << ": " << id.status();
    EXPECT_THAT(std::string(id.status().message()), HasSubstr(field));
  };
  refused(Request({}, 4, 1.0, 1), "prompt: empty");
  refused(Request({1, f.config.vocab_size}, 4, 1.0, 1), "prompt[1]");
  refused(Request({1, -1}, 4, 1.0, 1), "prompt[1]");
  refused(Request({1}, 0, 1.0, 1), "max_tokens");
  refused(Request({1}, f.config.max_position_embeddings, 1.0, 1), "max_tokens");
  refused(Request({1}, 4, 1.0, 1, 0), "num_samples");
  refused(Request({1}, 4, 1.0, 1, kMaxSamplesPerPrompt + 1), "num_samples");
  refused(Request({1}, 4, -0.5, 1), "temperature");
  refused(Request({1}, 4, std::nan(""), 1), "temperature");
  SampleRequest r = Request({1}, 4, 1.0, 1);
  r.params.top_p = 0;
  refused(r, "top_p");
  r.params.top_p = 1.5;
  refused(r, "top_p");
  r = Request({1}, 4, 1.0, 1);
  r.params.top_k = -1;
  refused(r, "top_k");
  r = Request({1}, 4, 1.0, 1);
  r.params.min_p = 1;
  refused(r, "min_p");
  r = Request({1}, 4, 1.0, 1);
  r.params.stop_token_ids = {f.config.vocab_size};
  refused(r, "stop_token_ids[0]");
  r = Request({1}, 4, 1.0, 1);
  r.params.stop_sequences = {{}};
  refused(r, "stop_sequences[0]");
  r = Request({1}, 4, 1.0, 1);
  r.params.top_logprobs = kMaxTopLogprobs + 1;
  refused(r, "top_logprobs");
  r.params.top_logprobs = 0;
  r.params.prompt_top_logprobs = 3;  // without prompt_logprobs
  refused(r, "prompt_top_logprobs: needs prompt_logprobs");
  r.params.prompt_logprobs = true;
  r.params.prompt_top_logprobs = kMaxTopLogprobs + 1;
  refused(r, "prompt_top_logprobs");
  EXPECT_TRUE(engine.Idle());
}

// A request that could need more blocks than the cache holds is refused at once; requests
// that fit only one after another wait and then run; a cancelled request's blocks are free.
TEST(SamplerTest, TheCacheBudgetIsKeptAndCancellingFreesBlocks) {
  Fixture f;
  KvBlockPool pool = f.Pool(8, 4);  // 32 positions
  SamplerEngine engine(f.config, f.weights, &pool, {});
  absl::StatusOr<int64_t> too_big = engine.Add(&f.adapter, Request({1, 2, 3}, 40, 1.0, 1));
  EXPECT_TRUE(absl::IsResourceExhausted(too_big.status())) << too_big.status();
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("kv cache"));
  // Each needs 5 blocks at most (3 + 14 positions): the second waits for the first.
  ASSERT_OK_AND_ASSIGN(int64_t first, engine.Add(&f.adapter, Request({1, 2, 3}, 14, 1.0, 1)));
  ASSERT_OK_AND_ASSIGN(int64_t second, engine.Add(&f.adapter, Request({4, 5, 6}, 14, 1.0, 2)));
  ASSERT_OK(engine.Step());
  EXPECT_EQ(engine.running_sequences(), 1);
  EXPECT_EQ(engine.waiting_requests(), 1);
  EXPECT_LT(pool.free_blocks(), pool.total_blocks());
  engine.Cancel(first);
  EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
  for (int steps = 0; !engine.Idle() && steps < 100; ++steps) ASSERT_OK(engine.Step());
  EXPECT_FALSE(engine.Take(first).has_value());
  std::optional<SampleResult> done = engine.Take(second);
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->sequences[0].tokens.size(), 14u);
  EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
}

// Qwen3.5's linear-attention layers keep no keys or values (their state is per sequence):
// the pool holds the attention layers only, and the budget splits between blocks and states.
TEST(SamplerTest, LinearAttentionLayersKeepStatesNotBlocks) {
  const ModelConfig c = ModelConfigPreset("tiny-qwen3.5").value();  // layer 0 linear, layer 1 attention
  const KvShape shape = KvShapeFor(c, 0, c.num_hidden_layers, c.num_key_value_heads);
  KvShape every_layer = shape;
  every_layer.cached.clear();
  EXPECT_EQ(KvBlockPool::BytesPerBlock(every_layer, at::kFloat), 2 * KvBlockPool::BytesPerBlock(shape, at::kFloat));
  ASSERT_OK_AND_ASSIGN(KvBlockPool pool, KvBlockPool::Create(shape, 4, at::kFloat, at::kCPU));
  EXPECT_FALSE(pool.keys(0).defined());
  EXPECT_TRUE(pool.keys(1).defined());
  KvShape linear_only = shape;
  linear_only.layers = 1;  // layer 0 alone: nothing to cache
  EXPECT_THAT(KvBlockPool::Create(linear_only, 4, at::kFloat, at::kCPU).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "no layer of this shard keeps keys and values"));
  // One linear layer: the convolution's last 3 rows of 2 x 2 x 8 + 4 x 8 channels, and a
  // 4 x 8 x 8 fp32 state.
  EXPECT_EQ(RecurrentStateBytes(c, nullptr, 0, 2, at::kFloat), 3 * 64 * 4 + 4 * 8 * 8 * 4);
  EXPECT_EQ(RecurrentStateBytes(c, nullptr, 1, 1, at::kFloat), 0);
  EXPECT_EQ(RecurrentStateBytes(ModelConfigPreset("tiny").value(), nullptr, 0, 2, at::kFloat), 0);
  // 1,000 bytes, 10 a block of 4, 100 a state: 8 sequences of 8 positions (2 blocks and a
  // state each) and the rest in blocks; without states, all blocks.
  SamplingBudget b = SplitSamplingBudget(1000, 10, 4, 100, 8);
  EXPECT_EQ(b.recurrent_sequences, 8);
  EXPECT_EQ(b.blocks, 20);
  b = SplitSamplingBudget(1000, 10, 4, 0, 8);
  EXPECT_EQ(b.recurrent_sequences, 0);
  EXPECT_EQ(b.blocks, 100);
  b = SplitSamplingBudget(115, 10, 4, 100, 2048);  // short of a typical sequence: one shorter one
  EXPECT_EQ(b.recurrent_sequences, 1);
  EXPECT_EQ(b.blocks, 1);
  b = SplitSamplingBudget(105, 10, 4, 100, 2048);  // not even a block beside one state: the worker refuses
  EXPECT_EQ(b.recurrent_sequences, 0);
}

// A request waits until its sequences' recurrent states fit beside the admitted ones', one
// that could never fit is refused naming the limit, and the results are those of each alone.
TEST(SamplerTest, RecurrentStatesAreBudgetedLikeBlocks) {
  Fixture f(ModelConfigPreset("tiny-qwen3.5").value());
  KvBlockPool pool = f.Pool(64, 4);
  SamplerOptions options;
  options.max_recurrent_sequences = 3;
  SamplerEngine engine(f.config, f.weights, &pool, options);
  absl::StatusOr<int64_t> too_many = engine.Add(&f.adapter, Request({1, 2, 3}, 4, 1.0, 1, /*num_samples=*/3));
  EXPECT_THAT(too_many.status(), StatusIs(absl::StatusCode::kResourceExhausted, "linear-attention state"));
  EXPECT_EQ(engine.waiting_requests(), 0);
  // Two samples and their prompt: 3 states; the next request's one waits for them.
  const SampleRequest pair = Request({1, 2, 3}, 6, 0.0, 1, 2), single = Request({4, 5, 6, 7}, 5, 0.0, 2);
  ASSERT_OK_AND_ASSIGN(int64_t first, engine.Add(&f.adapter, pair));
  ASSERT_OK_AND_ASSIGN(int64_t second, engine.Add(&f.adapter, single));
  ASSERT_OK(engine.Step());
  EXPECT_EQ(engine.waiting_requests(), 1);
  for (int steps = 0; !engine.Idle() && steps < 100; ++steps) ASSERT_OK(engine.Step());
  std::optional<SampleResult> a = engine.Take(first), b = engine.Take(second);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(a->sequences[1].tokens, RunAll(f, &pool, {{&f.adapter, pair}})[0].sequences[1].tokens);
  EXPECT_EQ(b->sequences[0].tokens, RunAll(f, &pool, {{&f.adapter, single}})[0].sequences[0].tokens);
  EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
}

}  // namespace
}  // namespace lorastep
