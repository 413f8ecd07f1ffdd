// The sampler on a real model folder (the GPU suite `sampler` of scripts/bench.py runs it
// beside bench/hf_generate.py): the SamplerEngine alone, in process, with a LoRA adapter of
// rank RANK on every linear of the decoder (factors drawn at random, small).
//   sampler_gpu_bench MODEL_DIR DTYPE BATCHES PROMPT NEW [SIDE_NEW]
// BATCHES: comma-separated batch sizes; each batch samples BATCH prompts of PROMPT random
// tokens, one sample each, NEW tokens each (no stop token, temperature 1). Prints name=value
// lines, per batch B:
//   b{B}_wall_s, b{B}_tokens_per_s        the whole call: B * NEW / wall (prefill included)
//   b{B}_decode_tokens_per_s              steps that decode only: their tokens / their time
//   b{B}_decode_step_ms                   median time of such a step
//   b{B}_roofline_fraction                (weight bytes + key/value bytes read by the median
//                                          decode step) / its time / copy_bandwidth
// and once:
//   copy_bandwidth_gbs                    a 1 GiB device copy: bytes read + written / time
//   weight_bytes, kv_bytes_per_position
//   mismatch_max, mismatch_mean           the first batch of >= 16: each sampled token's log-prob
//                                          against the trainer's forward of the returned
//                                          sequence (no cache, its own attention)
//   adapters8_wall_s, adapters1_wall_s    64 prompts over 8 adapters (8 each) against one
//                                          adapter, SIDE_NEW tokens (default 128)
//   prefix16_wall_s, separate16_wall_s    4 prompts x 16 samples against 64 one-sample requests
//                                          with the same seeds, SIDE_NEW tokens
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "bench/sample_requests.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "lib/model/adapter.h"
#include "lib/model/model_weights.h"
#include "lib/model/qwen2.h"
#include "lib/sampling/kv_blocks.h"
#include "lib/sampling/sampler.h"
#include "tools/random_lora.h"

namespace lorastep {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

void Die(const std::string& what) {
  std::fprintf(stderr, "sampler_gpu_bench: %s\n", what.c_str());
  std::exit(1);
}

void Sync(const at::Device& device) {
  if (device.is_cuda()) at::zeros({1}, at::TensorOptions().device(device)).item<float>();  // waits for the queue
}

Adapter RandomLora(const ModelConfig& config, int64_t rank, const at::Device& device, at::ScalarType dtype,
                   uint64_t seed) {
  LoraConfig lora;
  lora.rank = rank;
  lora.alpha = 2.0 * static_cast<double>(rank);
  lora.target_modules = {"all-linear"};
  absl::StatusOr<Adapter> a = Adapter::CreateLora(config, lora, device, dtype, seed);
  if (!a.ok()) Die(a.status().ToString());
  DrawLoraFactors(*a, seed, 0.01);
  return std::move(*a);
}

struct Timed {
  std::vector<SampleResult> results;
  double wall_s = 0;
  double decode_s = 0;           // steps that only decoded
  int64_t decode_tokens = 0;
  std::vector<double> decode_step_s;
};

Timed Run(const ModelConfig& config, const ModelWeights& weights, KvBlockPool* pool,
          const std::vector<std::pair<const Adapter*, SampleRequest>>& requests) {
  SamplerEngine engine(config, weights, pool, SamplerOptions());
  std::vector<int64_t> ids;
  Timed t;
  Sync(weights.output_weight().device());
  const Clock::time_point start = Clock::now();
  for (const auto& [adapter, request] : requests) {
    absl::StatusOr<int64_t> id = engine.Add(adapter, request);
    if (!id.ok()) Die(id.status().ToString());
    ids.push_back(*id);
  }
  while (!engine.Idle()) {
    const Clock::time_point step = Clock::now();
    // Each step ends with its draws copied to the host: its time is the device's.
    if (absl::Status s = engine.Step(); !s.ok()) Die(s.ToString());
    if (engine.last_step().prefill_tokens == 0 && engine.last_step().decode_tokens > 0) {
      t.decode_step_s.push_back(Seconds(step));
      t.decode_s += t.decode_step_s.back();
      t.decode_tokens += engine.last_step().decode_tokens;
    }
  }
  t.wall_s = Seconds(start);
  for (int64_t id : ids) t.results.push_back(*engine.Take(id));
  return t;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  if (argc < 6) Die("usage: sampler_gpu_bench MODEL_DIR DTYPE BATCHES PROMPT NEW [SIDE_NEW]");
  const std::string folder = argv[1];
  const at::ScalarType dtype = std::string(argv[2]) == "float32" ? at::kFloat : at::kBFloat16;
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(argv[3], ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(b, &n) || n < 1) Die("BATCHES: not a list of positive integers");
    batches.push_back(n);
  }
  const int64_t prompt_tokens = std::atoll(argv[4]), new_tokens = std::atoll(argv[5]);
  const int64_t side_new = argc > 6 ? std::atoll(argv[6]) : 128;
  const at::Device device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  absl::StatusOr<LoadedModel> loaded = LoadModel(folder, device, dtype);
  if (!loaded.ok()) Die(loaded.status().ToString());
  const ModelConfig& config = loaded->config;
  const ModelWeights& weights = loaded->weights;
  const int64_t rank = 16;
  std::vector<Adapter> adapters;
  for (uint64_t i = 0; i < 8; ++i) adapters.push_back(RandomLora(config, rank, device, dtype, 100 + i));
  const Adapter& adapter = adapters[0];

  // What a decode step reads: every weight but an untied embedding (a few rows gathered),
  // the adapter, and each sequence's keys and values.
  int64_t weight_bytes = 0;
  ForEachNamedTensor(weights, [&](const std::string&, const at::Tensor& t) { weight_bytes += t.nbytes(); });
  if (weights.lm_head.defined()) weight_bytes -= weights.embed_tokens.nbytes();
  for (const Parameter& p : adapter.parameters()) weight_bytes += p.value.nbytes();
  const KvShape shape = KvShapeFor(config, 0, config.num_hidden_layers, config.num_key_value_heads);
  const int64_t kv_position_bytes = KvBlockPool::BytesPerBlock(shape, dtype) / shape.block_size;
  std::printf("weight_bytes=%lld\nkv_bytes_per_position=%lld\n", static_cast<long long>(weight_bytes),
              static_cast<long long>(kv_position_bytes));

  // Copy bandwidth: 1 GiB copied, bytes read and written over the time.
  const double bandwidth = [&] {
    const int64_t bytes = int64_t{1} << 30;
    at::Tensor a = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device)).fill_(1);
    at::Tensor b = at::empty_like(a);
    b.copy_(a);
    Sync(device);
    const int reps = device.is_cuda() ? 20 : 2;
    const Clock::time_point t0 = Clock::now();
    for (int i = 0; i < reps; ++i) b.copy_(a);
    Sync(device);
    return 2.0 * static_cast<double>(bytes) * reps / Seconds(t0);
  }();
  std::printf("copy_bandwidth_gbs=%.1f\n", bandwidth / 1e9);

  const int64_t largest = *std::max_element(batches.begin(), batches.end());
  const int64_t per_sequence = (prompt_tokens + std::max(new_tokens, side_new) + shape.block_size - 1) / shape.block_size + 1;
  absl::StatusOr<KvBlockPool> pool = KvBlockPool::Create(shape, std::max<int64_t>(largest, 64) * per_sequence + 64, dtype, device);
  if (!pool.ok()) Die(pool.status().ToString());
  at::manual_seed(7);
  auto prompt = [&](int64_t n) {
    const at::Tensor ids = at::randint(0, config.vocab_size, {n}, at::kLong);
    return std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
  };
  // Warm-up: kernels chosen, allocator grown.
  {
    std::vector<std::pair<const Adapter*, SampleRequest>> warm;
    for (int i = 0; i < 8; ++i) warm.push_back({&adapter, TemperatureOneRequest(prompt(prompt_tokens), 1, 8, i)});
    Run(config, weights, &*pool, warm);
  }
  bool mismatch_done = false;
  for (int64_t batch : batches) {
    std::vector<std::pair<const Adapter*, SampleRequest>> requests;
    for (int64_t i = 0; i < batch; ++i) requests.push_back({&adapter, TemperatureOneRequest(prompt(prompt_tokens), 1, new_tokens, 1000 + i)});
    const Timed t = Run(config, weights, &*pool, requests);
    const double step_s = Median(t.decode_step_s);
    // The median decode step reads, per sequence, about the prompt and half the new tokens.
    const double kv_read = static_cast<double>(batch) * static_cast<double>(prompt_tokens + new_tokens / 2) *
                           static_cast<double>(kv_position_bytes);
    std::printf("b%lld_wall_s=%.4f\nb%lld_tokens_per_s=%.1f\nb%lld_decode_tokens_per_s=%.1f\n", static_cast<long long>(batch),
                t.wall_s, static_cast<long long>(batch), static_cast<double>(batch * new_tokens) / t.wall_s,
                static_cast<long long>(batch), t.decode_s > 0 ? static_cast<double>(t.decode_tokens) / t.decode_s : 0.0);
    std::printf("b%lld_decode_step_ms=%.3f\nb%lld_roofline_fraction=%.4f\n", static_cast<long long>(batch), step_s * 1e3,
                static_cast<long long>(batch),
                step_s > 0 ? (static_cast<double>(weight_bytes) + kv_read) / step_s / bandwidth : 0.0);
    std::fflush(stdout);
    if (mismatch_done || batch < 16) continue;
    mismatch_done = true;
    // The trainer's forward of each returned sequence, without the cache.
    double worst = 0, sum = 0;
    int64_t count = 0;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < requests.size(); ++i) {
      const std::vector<int64_t>& p = requests[i].second.prompt;
      const SampledSequence& s = t.results[i].sequences[0];
      std::vector<int64_t> seq = p;
      seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
      ForwardOptions options;
      options.training = false;
      const at::Tensor input = at::tensor(std::vector<int64_t>(seq.begin(), seq.end() - 1), at::kLong).to(device);
      const at::Tensor hidden = Qwen2Hidden(config, weights, &adapter, input.unsqueeze(0), options)[0];
      const at::Tensor targets = at::tensor(std::vector<int64_t>(seq.begin() + 1, seq.end()), at::kLong).to(device);
      const at::Tensor scores =
          Qwen2HeadScores(weights, &adapter, hidden, targets, 4096, options, {}, false).logprobs.to(at::kCPU);
      for (size_t k = 0; k < s.tokens.size(); ++k) {
        const double d = std::abs(s.logprobs[k] - scores[static_cast<int64_t>(p.size() - 1 + k)].item<double>());
        worst = std::max(worst, d);
        sum += d;
        ++count;
      }
    }
    std::printf("mismatch_batch=%lld\nmismatch_max=%.4g\nmismatch_mean=%.4g\n", static_cast<long long>(batch), worst,
                sum / static_cast<double>(count));
    std::fflush(stdout);
  }
  // 64 prompts: 8 adapters of 8 prompts each against one adapter.
  {
    std::vector<std::pair<const Adapter*, SampleRequest>> one, eight;
    for (int64_t i = 0; i < 64; ++i) {
      const std::vector<int64_t> p = prompt(prompt_tokens);
      one.push_back({&adapter, TemperatureOneRequest(p, 1, side_new, 2000 + i)});
      eight.push_back({&adapters[i % 8], TemperatureOneRequest(p, 1, side_new, 2000 + i)});
    }
    std::printf("adapters1_wall_s=%.4f\n", Run(config, weights, &*pool, one).wall_s);
    std::printf("adapters8_wall_s=%.4f\n", Run(config, weights, &*pool, eight).wall_s);
  }
  // 16 samples per prompt sharing its prefill against separate requests.
  {
    std::vector<std::pair<const Adapter*, SampleRequest>> shared, separate;
    for (int64_t i = 0; i < 4; ++i) {
      const std::vector<int64_t> p = prompt(prompt_tokens);
      shared.push_back({&adapter, TemperatureOneRequest(p, 16, side_new, 3000 + 16 * i)});
      for (int64_t j = 0; j < 16; ++j) separate.push_back({&adapter, TemperatureOneRequest(p, 1, side_new, 3000 + 16 * i + j)});
    }
    std::printf("prefix16_wall_s=%.4f\n", Run(config, weights, &*pool, shared).wall_s);
    std::printf("separate16_wall_s=%.4f\n", Run(config, weights, &*pool, separate).wall_s);
  }
  std::printf("side_new_tokens=%lld\nlora_rank=%lld\n", static_cast<long long>(side_new), static_cast<long long>(rank));
  return 0;
}

}  // namespace
}  // namespace lorastep

int main(int argc, char** argv) { return lorastep::Main(argc, argv); }
