#include "lib/model/rope.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {

// The length the model was trained at, which the scaled variants stretch.
int64_t OriginalLength(const ModelConfig& c) {
  return c.rope.original_max_position_embeddings > 0 ? c.rope.original_max_position_embeddings
                                                     : c.max_position_embeddings;
}

}  // namespace

std::pair<at::Tensor, double> RopeFrequencies(const ModelConfig& c, int64_t length) {
  const int64_t d = c.rotary_dim();  // partial rotary (Qwen3.5): the first dimensions only
  const RopeConfig& r = c.rope;
  const at::Tensor exponents = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  auto inverse = [&](double base) { return 1.0 / at::pow(base, exponents); };
  const int64_t original = OriginalLength(c);
  if (r.type == "linear") return {inverse(c.rope_theta) / r.factor, 1.0};
  if (r.type == "dynamic") {
    const double n = static_cast<double>(std::max(length, original));
    const double base = c.rope_theta * std::pow(r.factor * n / static_cast<double>(original) - (r.factor - 1),
                                                static_cast<double>(d) / static_cast<double>(d - 2));
    return {inverse(base), 1.0};
  }
  if (r.type == "yarn") {
    const double attention = r.attention_factor > 0 ? r.attention_factor
                             : r.factor <= 1        ? 1.0
                                                    : 0.1 * std::log(r.factor) + 1.0;
    const at::Tensor pos_freqs = at::pow(c.rope_theta, exponents);
    const at::Tensor extrapolation = 1.0 / pos_freqs;
    const at::Tensor interpolation = 1.0 / (r.factor * pos_freqs);
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(d) * std::log(static_cast<double>(original) / (rotations * 2 * M_PI))) /
             (2 * std::log(c.rope_theta));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(d - 1));
    if (low == high) high += 0.001;  // no division by zero
    const at::Tensor ramp = ((at::arange(d / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    const at::Tensor extrapolated = 1 - ramp;
    return {interpolation * (1 - extrapolated) + extrapolation * extrapolated, attention};
  }
  if (r.type == "llama3") {
    const at::Tensor inv = inverse(c.rope_theta);
    const double low_wavelen = static_cast<double>(original) / r.low_freq_factor;
    const double high_wavelen = static_cast<double>(original) / r.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    const at::Tensor smooth = (static_cast<double>(original) / wavelen - r.low_freq_factor) /
                              (r.high_freq_factor - r.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    return {at::where(medium, smoothed, scaled), 1.0};
  }
  return {inverse(c.rope_theta), 1.0};
}

std::pair<at::Tensor, at::Tensor> RopeTables(const ModelConfig& c, int64_t s,
                                             const at::TensorOptions& options) {
  const RopeConfig& r = c.rope;
  // Dynamic RoPE past its original length depends on the length: a table of its own.
  const int64_t original = OriginalLength(c);
  const int64_t own_length = r.type == "dynamic" && s > original ? s : 0;
  static std::mutex mu;
  using Key = std::tuple<std::string, int64_t, std::string, int, int64_t>;
  static auto* tables = new std::map<Key, std::pair<at::Tensor, at::Tensor>>();
  const std::string rope = absl::StrCat(c.rope_theta, ":", c.rotary_dim(), ":", r.type, ":", r.factor, ":",
                                        r.original_max_position_embeddings, ":", r.low_freq_factor, ":",
                                        r.high_freq_factor, ":", r.beta_fast, ":", r.beta_slow, ":",
                                        r.attention_factor, ":", r.truncate, ":", c.max_position_embeddings);
  const Key key{rope, c.rotary_dim(), options.device().str(), static_cast<int>(options.dtype().toScalarType()),
                own_length};
  std::lock_guard<std::mutex> lock(mu);
  auto& [cos, sin] = (*tables)[key];
  if (!cos.defined() || cos.size(0) < s) {
    const int64_t length = own_length > 0 ? s : std::max<int64_t>(s, cos.defined() ? 2 * cos.size(0) : s);
    auto [inv_freq, scale] = RopeFrequencies(c, s);
    at::Tensor pos = at::arange(length, at::kLong).to(at::kFloat);
    at::Tensor freqs = at::outer(pos, inv_freq);
    at::Tensor emb = at::cat({freqs, freqs}, -1).to(options.device());
    at::Tensor emb_cos = emb.cos(), emb_sin = emb.sin();
    if (scale != 1.0) {  // yarn's attention factor, in fp32 before the cast as transformers does
      emb_cos = emb_cos * scale;
      emb_sin = emb_sin * scale;
    }
    cos = emb_cos.to(options.dtype());
    sin = emb_sin.to(options.dtype());
  }
  return {cos.narrow(0, 0, s), sin.narrow(0, 0, s)};
}

}  // namespace lorastep
