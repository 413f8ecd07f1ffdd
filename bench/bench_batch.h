// The batches the service benchmarks send: a bench/make_batch.py file (the same sequences
// the transformers peer runs), or random tokens. Every datum carries sampler log-probs
// (-5) and advantages so the PPO loss applies.
#ifndef LORASTEP_BENCH_BENCH_BATCH_H_
#define LORASTEP_BENCH_BENCH_BATCH_H_

#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "lorastep/v1/trainer.pb.h"

namespace lorastep {

inline std::vector<v1::Datum> LoadBatchFile(const std::string& path) {
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  std::vector<v1::Datum> batch;
  for (const auto& seq : j.at("sequences")) {
    v1::Datum& d = batch.emplace_back();
    for (int64_t t : seq.at("tokens")) d.add_tokens(t);
    for (int64_t t : seq.at("targets")) d.add_target_tokens(t);
    for (double a : seq.at("advantages")) {
      d.add_advantages(static_cast<float>(a));
      d.add_logprobs(-5.0f);
    }
  }
  return batch;
}

// `seqs` x `len` random tokens; the first quarter of each sequence is prompt (advantage 0).
// next_token_targets: each sequence is a random stream of len + 1 tokens, its targets its
// tokens shifted by one, as in an RL rollout (the client then sends only each datum's last
// target); otherwise the targets are random tokens of their own.
inline std::vector<v1::Datum> RandomBatch(int seqs, int len, int64_t vocab, uint32_t seed = 1,
                                          bool next_token_targets = false) {
  std::mt19937 rng(seed);
  std::vector<v1::Datum> batch(seqs);
  for (auto& d : batch) {
    int64_t next = next_token_targets ? rng() % vocab : 0;
    for (int i = 0; i < len; ++i) {
      d.add_tokens(next_token_targets ? next : rng() % vocab);
      next = rng() % vocab;
      d.add_target_tokens(next);
      d.add_logprobs(-5.0f);
      d.add_advantages(i < len / 4 ? 0.0f : ((rng() % 2) ? 1.0f : -1.0f));
    }
  }
  return batch;
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_BENCH_BATCH_H_
