// A local GRPO-style training run through lib/ (no service): generates a small model, makes
// synthetic rollouts whose reward is the share of "good" tokens (ids below vocab/8) in each
// response, re-scores old log-probs with Forward, and trains with PPO. The mean log-prob the
// policy gives good tokens rises step by step.
//   lorastep_demo [--steps N] [--preset small] [--workdir DIR]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "lib/flags_util.h"
#include "lib/model/model_weights.h"
#include "lib/training/trainer.h"
#include "tools/model_presets.h"

using namespace lorastep;

ABSL_FLAG(int, steps, 8, "training steps");
ABSL_FLAG(std::string, preset, "small", "model shape (lorastep_genmodel's presets)");
ABSL_FLAG(std::string, workdir, "/tmp/lorastep-demo", "where the generated model is written");

int main(int argc, char** argv) {
  ParseCommandLineOrExit(argc, argv, "lorastep_demo [--steps N] [--preset small] [--workdir DIR]");
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string preset = absl::GetFlag(FLAGS_preset), workdir = absl::GetFlag(FLAGS_workdir);
  ModelConfig config = ModelConfigPreset(preset).value();
  const std::string model_dir = workdir + "/model";
  if (auto s = SaveModel(model_dir, config, RandomModelWeights(config, 1)); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  auto base = LoadBaseModel(model_dir, "cpu", "float32");
  if (!base.ok()) { std::cerr << base.status() << "\n"; return 1; }
  TrainerOptions options;
  options.lora.rank = 16;
  options.lora.alpha = 32;
  options.max_tokens_per_microbatch = 2048;
  auto trainer = Trainer::Create(*base, options);
  if (!trainer.ok()) { std::cerr << trainer.status() << "\n"; return 1; }

  LossConfig loss;
  loss.kind = LossKind::kPpo;
  loss.clip_eps_low = 0.2;
  loss.clip_eps_high = 0.28;
  AdamWParams adam;
  adam.lr = 2e-3;
  adam.beta2 = 0.98;
  adam.weight_decay = 0.1;
  adam.max_grad_norm = 1.0;

  const int64_t good_below = config.vocab_size / 8;
  std::mt19937 rng(7);
  std::printf("%4s %10s %10s %11s %10s %9s %10s %14s\n", "step", "loss", "reward", "clipfrac",
              "ppo_kl", "grad_norm", "tokens/s", "good_logprob");
  for (int step = 0; step < steps; ++step) {
    // 8 prompts x 8 responses; responses mix good and other tokens at random rates.
    std::vector<Datum> batch;
    std::vector<double> rewards;
    for (int p = 0; p < 8; ++p) {
      std::vector<Datum> group;
      std::vector<double> group_rewards;
      for (int r = 0; r < 8; ++r) {
        Datum d;
        const int prompt_len = 16, response_len = 48;
        std::uniform_real_distribution<double> u(0, 1);
        const double good_rate = u(rng);
        int good = 0;
        std::vector<int64_t> seq;
        for (int i = 0; i < prompt_len; ++i) seq.push_back((p * 31 + i * 7) % config.vocab_size);
        for (int i = 0; i < response_len; ++i) {
          const bool g = u(rng) < good_rate;
          good += g;
          seq.push_back(g ? rng() % good_below : good_below + rng() % (config.vocab_size - good_below));
        }
        for (size_t i = 0; i + 1 < seq.size(); ++i) {
          d.tokens.push_back(seq[i]);
          d.target_tokens.push_back(seq[i + 1]);
          d.weights.push_back(i + 1 >= static_cast<size_t>(prompt_len) ? 1.0f : 0.0f);
        }
        group_rewards.push_back(static_cast<double>(good) / response_len);
        group.push_back(d);
      }
      // GRPO: group-normalized, token-constant advantages.
      double mean = 0, var = 0;
      for (double x : group_rewards) mean += x / 8;
      for (double x : group_rewards) var += (x - mean) * (x - mean) / 8;
      for (int r = 0; r < 8; ++r) {
        const float a = static_cast<float>((group_rewards[r] - mean) / (std::sqrt(var) + 1e-6));
        group[r].advantages.assign(group[r].tokens.size(), a);
        batch.push_back(group[r]);
        rewards.push_back(group_rewards[r]);
      }
    }
    // Old log-probs from the current policy (the sampler would send its own; here they agree).
    auto old = (*trainer)->Forward(batch);
    if (!old.ok()) { std::cerr << old.status() << "\n"; return 1; }
    double good_lp = 0, good_n = 0, mean_reward = 0;
    for (size_t d = 0; d < batch.size(); ++d) {
      batch[d].logprobs = old->logprobs[d];
      mean_reward += rewards[d] / batch.size();
      for (size_t i = 0; i < batch[d].tokens.size(); ++i) {
        if (batch[d].weights[i] > 0 && batch[d].target_tokens[i] < good_below) {
          good_lp += old->logprobs[d][i];
          good_n += 1;
        }
      }
    }
    auto result = (*trainer)->TrainStep(batch, loss, adam);
    if (!result.ok()) { std::cerr << result.status() << "\n"; return 1; }
    const Metrics& m = result->metrics;
    std::printf("%4d %10.5f %10.4f %11.5f %10.6f %9.4f %10.0f %14.4f\n", step,
                m.Get("loss:sum"), mean_reward, m.Get("pg_clipfrac:mean"), m.Get("ppo_kl:mean"),
                m.Get("grad_norm:sum"), m.Get("tokens_per_s:sum"), good_lp / good_n);
  }
  if (auto s = (*trainer)->ExportAdapter(workdir + "/adapter"); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "adapter (PEFT format) written to " << workdir << "/adapter, sha256 "
            << (*trainer)->AdapterSha256() << "\n";
  return 0;
}
