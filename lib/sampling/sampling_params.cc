#include "lib/sampling/sampling_params.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace lorastep {

absl::Status CheckSamplingParams(const SamplingParams& p, int64_t vocab, const std::string& field) {
  auto bad = [&](const char* name, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(field, name, ": ", why));
  };
  if (p.max_tokens < 1) return bad("max_tokens", absl::StrCat(p.max_tokens, " is less than 1"));
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return bad("temperature", absl::StrCat(p.temperature, " is not a finite value >= 0"));
  }
  if (p.top_k < 0) return bad("top_k", absl::StrCat(p.top_k, " is negative"));
  if (!(p.top_p > 0 && p.top_p <= 1)) return bad("top_p", absl::StrCat(p.top_p, " is not in (0, 1]"));
  if (!(p.min_p >= 0 && p.min_p < 1)) return bad("min_p", absl::StrCat(p.min_p, " is not in [0, 1)"));
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs) {
    return bad("top_logprobs", absl::StrCat(p.top_logprobs, " is not in [0, ", kMaxTopLogprobs, "]"));
  }
  if (p.prompt_top_logprobs < 0 || p.prompt_top_logprobs > kMaxTopLogprobs) {
    return bad("prompt_top_logprobs", absl::StrCat(p.prompt_top_logprobs, " is not in [0, ", kMaxTopLogprobs, "]"));
  }
  if (p.prompt_top_logprobs > 0 && !p.prompt_logprobs) {
    return bad("prompt_top_logprobs", "needs prompt_logprobs");
  }
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    if (p.stop_token_ids[i] < 0 || p.stop_token_ids[i] >= vocab) {
      return bad(absl::StrCat("stop_token_ids[", i, "]").c_str(),
                 absl::StrCat(p.stop_token_ids[i], " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  for (size_t i = 0; i < p.stop_sequences.size(); ++i) {
    if (p.stop_sequences[i].empty()) return bad(absl::StrCat("stop_sequences[", i, "]").c_str(), "empty");
    for (int64_t t : p.stop_sequences[i]) {
      if (t < 0 || t >= vocab) {
        return bad(absl::StrCat("stop_sequences[", i, "]").c_str(),
                   absl::StrCat("token ", t, " is outside the vocabulary [0, ", vocab, ")"));
      }
    }
  }
  return absl::OkStatus();
}

at::Tensor SamplingLogProbs(const at::Tensor& logits, const SamplingParams& p) {
  const at::Tensor x = logits.to(at::kFloat).contiguous();
  const int64_t vocab = x.size(-1);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  if (p.temperature == 0) {
    // The argmax (the first of equal maxima) with probability 1.
    return at::full_like(x, minus_inf).scatter_(-1, x.argmax(-1, /*keepdim=*/true), 0.0f);
  }
  at::Tensor scaled = x / p.temperature;
  at::Tensor keep = at::ones_like(x, x.options().dtype(at::kBool));
  if (p.top_k > 0 && p.top_k < vocab) {
    const at::Tensor kth = std::get<0>(scaled.topk(p.top_k, -1)).narrow(-1, p.top_k - 1, 1);
    keep &= scaled >= kth;
  }
  if (p.top_p < 1) {
    // The most likely tokens, in descending order, until their mass reaches top_p (the one
    // that crosses it kept).
    const at::Tensor probs = at::softmax(scaled.masked_fill(~keep, minus_inf), -1);
    auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    const at::Tensor before = sorted.cumsum(-1) - sorted;  // mass of the more likely tokens
    keep &= at::zeros_like(keep).scatter_(-1, order, before < p.top_p);
  }
  if (p.min_p > 0) {
    const at::Tensor probs = at::softmax(scaled.masked_fill(~keep, minus_inf), -1);
    keep &= probs >= std::get<0>(probs.max(-1, /*keepdim=*/true)) * p.min_p;
  }
  return at::log_softmax(scaled.masked_fill(~keep, minus_inf), -1);
}

namespace {

uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

SampleStream::SampleStream(uint64_t seed) : state_(seed) { SplitMix64(state_); }

double SampleStream::Uniform() { return static_cast<double>(SplitMix64(state_) >> 11) * 0x1.0p-53; }

at::Tensor DrawTokens(const at::Tensor& sampling_logprobs, const std::vector<double>& u) {
  const at::Tensor probs = sampling_logprobs.to(at::kDouble).exp();
  const at::Tensor cumulative = probs.cumsum(-1);
  const int64_t vocab = probs.size(-1);
  const at::Tensor target = at::tensor(u, at::kDouble).to(probs.device()) * cumulative.select(-1, vocab - 1);
  // The first position whose cumulative mass passes the target (its probability is > 0, as
  // the mass rises there); none when u * total rounds up to the whole mass: the last kept.
  const at::Tensor crossed = cumulative > target.unsqueeze(-1);
  const at::Tensor first = crossed.to(at::kByte).argmax(-1);
  const at::Tensor ids = at::arange(vocab, probs.options().dtype(at::kLong));
  const at::Tensor last_kept = at::where(probs > 0, ids, at::zeros_like(ids)).amax(-1);
  return at::where(crossed.any(-1), first, last_kept);
}

int64_t DrawToken(const at::Tensor& sampling_logprobs, double u) {
  return DrawTokens(sampling_logprobs.unsqueeze(0), {u})[0].item<int64_t>();
}

}  // namespace lorastep
