// The sampler's CPU figures (bench/sampler.sh writes them to bench/results/sampler.json), on a
// generated tiny Qwen2-shaped model in fp32 with a LoRA adapter (head included, factors drawn
// at random so the adapter matters):
//   cpu_parity_max_abs_logprob_diff: over 16 prompts x 8 samples of 32 tokens at temperature 1,
//     the largest |sampler log-prob - the trainer's score of the returned sequence|
//     (Qwen2HeadScores after the forward, what Forward computes);
//   same_seed_identical: the same request twice gives the same tokens (1) or not (0);
//   batch_independent_max_abs_diff: a request alone against the same request batched with two
//     others (another adapter, the base model) in each step, largest log-prob difference (its
//     tokens must be identical, else the figure is reported as -1);
//   prefix_sharing_prefill_tokens_saved_fraction: 16 samples of one 64-token prompt, prompt
//     tokens prefilled against 16 separate one-sample requests; and the two wall times.
// Prints name=value lines.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench/sample_requests.h"
#include "lib/model/adapter.h"
#include "lib/model/qwen2.h"
#include "lib/sampling/kv_blocks.h"
#include "lib/sampling/sampler.h"
#include "tools/model_presets.h"
#include "tools/random_lora.h"

namespace lorastep {
namespace {

Adapter RandomAdapter(const ModelConfig& config, uint64_t seed) {
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.target_modules = {"all-linear", "lm_head"};
  Adapter a = Adapter::CreateLora(config, lora, at::kCPU, at::kFloat, seed).value();
  DrawLoraFactors(a, seed, 0.2);
  return a;
}

std::vector<SampleResult> Run(const ModelConfig& config, const ModelWeights& weights, KvBlockPool* pool,
                              const std::vector<std::pair<const Adapter*, SampleRequest>>& requests) {
  SamplerEngine engine(config, weights, pool, SamplerOptions());
  std::vector<int64_t> ids;
  for (const auto& [adapter, request] : requests) ids.push_back(engine.Add(adapter, request).value());
  while (!engine.Idle()) {
    absl::Status s = engine.Step();
    if (!s.ok()) {
      std::fprintf(stderr, "sampler step failed: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  }
  std::vector<SampleResult> out;
  for (int64_t id : ids) out.push_back(*engine.Take(id));
  return out;
}

int Main() {
  const ModelConfig config = ModelConfigPreset("tiny").value();
  const ModelWeights weights = RandomModelWeights(config, 1);
  const Adapter adapter = RandomAdapter(config, 3), other = RandomAdapter(config, 4);
  const KvShape shape = KvShapeFor(config, 0, config.num_hidden_layers, config.num_key_value_heads);
  KvBlockPool pool = KvBlockPool::Create(shape, 4096, at::kFloat, at::kCPU).value();
  at::manual_seed(7);
  auto prompt = [&](int64_t n) {
    std::vector<int64_t> p;
    for (int64_t i = 0; i < n; ++i) p.push_back(at::randint(0, config.vocab_size, {1}).item<int64_t>());
    return p;
  };
  // Parity with the trainer's scores.
  std::vector<std::pair<const Adapter*, SampleRequest>> parity;
  for (int i = 0; i < 16; ++i) parity.push_back({&adapter, TemperatureOneRequest(prompt(10 + i), 8, 32, 100 + i)});
  const std::vector<SampleResult> sampled = Run(config, weights, &pool, parity);
  double parity_max = 0;
  for (size_t i = 0; i < parity.size(); ++i) {
    const std::vector<int64_t>& p = parity[i].second.prompt;
    for (const SampledSequence& s : sampled[i].sequences) {
      std::vector<int64_t> seq = p;
      seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
      at::NoGradGuard no_grad;
      ForwardOptions options;
      options.training = false;
      const at::Tensor input = at::tensor(std::vector<int64_t>(seq.begin(), seq.end() - 1), at::kLong);
      const at::Tensor hidden = Qwen2Hidden(config, weights, &adapter, input.unsqueeze(0), options)[0];
      const at::Tensor targets = at::tensor(std::vector<int64_t>(seq.begin() + 1, seq.end()), at::kLong);
      const TokenScores scores = Qwen2HeadScores(weights, &adapter, hidden, targets, 1024, options, {}, false);
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        parity_max = std::max(parity_max, std::abs(s.logprobs[t] - scores.logprobs[p.size() - 1 + t].item<double>()));
      }
    }
  }
  std::printf("cpu_parity_max_abs_logprob_diff=%.3g\n", parity_max);
  std::printf("cpu_parity_tokens=%d\n", 16 * 8 * 32);
  // Same seed, and batched with others.
  const SampleRequest mine = TemperatureOneRequest(prompt(20), 4, 32, 5);
  const SampleResult alone = Run(config, weights, &pool, {{&adapter, mine}})[0];
  const SampleResult again = Run(config, weights, &pool, {{&adapter, mine}})[0];
  bool identical = true;
  for (size_t s = 0; s < alone.sequences.size(); ++s) identical &= alone.sequences[s].tokens == again.sequences[s].tokens;
  std::printf("same_seed_identical=%d\n", identical ? 1 : 0);
  const SampleResult batched =
      Run(config, weights, &pool, {{&other, TemperatureOneRequest(prompt(15), 4, 32, 9)}, {&adapter, mine}, {nullptr, TemperatureOneRequest(prompt(7), 4, 32, 11)}})[1];
  double batch_max = 0;
  for (size_t s = 0; s < alone.sequences.size(); ++s) {
    if (batched.sequences[s].tokens != alone.sequences[s].tokens) batch_max = -1;
    for (size_t t = 0; batch_max >= 0 && t < alone.sequences[s].logprobs.size(); ++t) {
      batch_max = std::max(batch_max, static_cast<double>(std::abs(batched.sequences[s].logprobs[t] - alone.sequences[s].logprobs[t])));
    }
  }
  std::printf("batch_independent_max_abs_diff=%.3g\n", batch_max);
  // Prefix sharing: 16 samples of one prompt against 16 one-sample requests.
  const std::vector<int64_t> long_prompt = prompt(64);
  auto timed = [&](const std::vector<std::pair<const Adapter*, SampleRequest>>& requests, int64_t* prefilled) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<SampleResult> r = Run(config, weights, &pool, requests);
    *prefilled = 0;
    for (const SampleResult& x : r) *prefilled += x.prefill_tokens;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<std::pair<const Adapter*, SampleRequest>> separate;
  for (int i = 0; i < 16; ++i) separate.push_back({&adapter, TemperatureOneRequest(long_prompt, 1, 16, 40 + i)});
  int64_t shared_prefill = 0, separate_prefill = 0;
  timed({{&adapter, TemperatureOneRequest(long_prompt, 16, 16, 40)}}, &shared_prefill);  // warm-up
  const double shared_s = timed({{&adapter, TemperatureOneRequest(long_prompt, 16, 16, 40)}}, &shared_prefill);
  const double separate_s = timed(separate, &separate_prefill);
  std::printf("prefix_sharing_prefill_tokens_saved_fraction=%.4f\n",
              1.0 - static_cast<double>(shared_prefill) / static_cast<double>(separate_prefill));
  std::printf("prefix_sharing_wall_s=%.4f\nseparate_requests_wall_s=%.4f\n", shared_s, separate_s);
  return 0;
}

}  // namespace
}  // namespace lorastep

int main() { return lorastep::Main(); }
