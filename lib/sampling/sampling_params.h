// How a sampled token is chosen from the model's logits, and the per-sequence random stream.
//
// The sampling distribution of one position: logits divided by the temperature, then top-k
// (the k largest kept), then top-p (the smallest set of the most likely tokens whose
// probability reaches p), then min-p (tokens at least min_p times the most likely one's
// probability), renormalized over what is kept. Temperature 0 is greedy: the argmax, with
// probability 1 (ties go to the lowest token id). The model's own log-prob of a token
// (temperature 1, nothing cut) is what the trainer computes; both are reported.
#ifndef LORASTEP_LIB_SAMPLING_SAMPLING_PARAMS_H_
#define LORASTEP_LIB_SAMPLING_SAMPLING_PARAMS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lib/sampling/sampling_bounds.h"

namespace lorastep {

struct SamplingParams {
  int64_t max_tokens = 16;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  uint64_t seed = 0;
  std::vector<int64_t> stop_token_ids;               // the model's EOS ids included by the caller
  std::vector<std::vector<int64_t>> stop_sequences;  // the completion ends after any of these
  int64_t top_logprobs = 0;                          // per sampled position, the k most likely tokens
  bool prompt_logprobs = false;
  int64_t prompt_top_logprobs = 0;  // with prompt_logprobs: per prompt position, the k most likely tokens
};

// INVALID_ARGUMENT naming the field (prefixed with `field`) for a value outside its range;
// `vocab` bounds the stop token ids.
absl::Status CheckSamplingParams(const SamplingParams& p, int64_t vocab, const std::string& field);

// The log-probs of the sampling distribution for logits [V] or rows of logits [n, V], each
// row on its own: -inf outside the kept set. Deterministic for equal logits.
at::Tensor SamplingLogProbs(const at::Tensor& logits, const SamplingParams& p);

// A sequence's own stream of uniform draws in [0, 1), from its seed alone, so its draws do
// not depend on what it is batched with. Sample i of a request with seed s draws from seed
// s + i: the same as a one-sample request with seed s + i.
class SampleStream {
 public:
  explicit SampleStream(uint64_t seed);
  double Uniform();

 private:
  uint64_t state_;
};

// Draws one token id per row of sampling log-probs [n, V] (on their device), row i with
// uniform u[i]: the first id whose cumulative probability (in id order, fp64) passes u[i]
// times the row's mass. int64 [n] on the same device; each row's draw depends on that row alone.
at::Tensor DrawTokens(const at::Tensor& sampling_logprobs, const std::vector<double>& u);
// The same for one row [V].
int64_t DrawToken(const at::Tensor& sampling_logprobs, double u);

}  // namespace lorastep

#endif  // LORASTEP_LIB_SAMPLING_SAMPLING_PARAMS_H_
