#include "lib/training/batch.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {

absl::Status CheckFloats(const std::vector<float>& values, size_t n, size_t datum,
                         const char* field, bool required) {
  if (values.empty()) {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat("datums[", datum, "].", field, ": required by this loss"));
    }
    return absl::OkStatus();
  }
  if (values.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("datums[", datum, "].", field, ": length ",
                                                   values.size(), " != tokens length ", n));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("datums[", datum, "].", field, "[", i, "]: not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTokens(const std::vector<Datum>& datums, int64_t vocab_size,
                         const BatchLimits& limits) {
  if (datums.empty()) return absl::InvalidArgumentError("datums: empty batch");
  if (static_cast<int64_t>(datums.size()) > limits.max_datums) {
    return absl::InvalidArgumentError(
        absl::StrCat("datums: ", datums.size(), " datums exceed the limit of ", limits.max_datums));
  }
  int64_t total = 0;
  for (size_t d = 0; d < datums.size(); ++d) {
    const Datum& datum = datums[d];
    const size_t n = datum.tokens.size();
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].tokens: empty"));
    if (static_cast<int64_t>(n) > limits.max_tokens_per_datum) {
      return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].tokens: length ", n,
                                                     " exceeds the limit of ",
                                                     limits.max_tokens_per_datum));
    }
    if (limits.max_positions > 0 && static_cast<int64_t>(n) > limits.max_positions) {
      return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].tokens: length ", n,
                                                     " exceeds the model's max_position_embeddings ",
                                                     limits.max_positions));
    }
    total += static_cast<int64_t>(n);
    if (datum.target_tokens.size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].target_tokens: length ",
                                                     datum.target_tokens.size(),
                                                     " != tokens length ", n));
    }
    for (const auto* field : {&datum.tokens, &datum.target_tokens}) {
      const char* name = field == &datum.tokens ? "tokens" : "target_tokens";
      for (size_t i = 0; i < n; ++i) {
        if ((*field)[i] < 0 || (*field)[i] >= vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].", name, "[", i, "]: id ",
                                                         (*field)[i], " outside [0, ", vocab_size,
                                                         ")"));
        }
      }
    }
  }
  if (total > limits.max_total_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("datums: ", total, " tokens exceed the limit of ",
                                                   limits.max_total_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

float LossMask(const Datum& datum, size_t i) {
  if (!datum.weights.empty()) return datum.weights[i];
  if (!datum.advantages.empty()) return datum.advantages[i] != 0.0f ? 1.0f : 0.0f;
  return 1.0f;
}

BatchTotals ComputeBatchTotals(const std::vector<Datum>& datums) {
  BatchTotals totals;
  for (const Datum& d : datums) {
    double n = 0;
    for (size_t i = 0; i < d.tokens.size(); ++i) n += LossMask(d, i) != 0 ? 1 : 0;
    totals.loss_tokens += n;
    totals.samples += n > 0 ? 1 : 0;
  }
  return totals;
}

absl::Status ValidateForwardBatch(const std::vector<Datum>& datums, int64_t vocab_size,
                                  const BatchLimits& limits) {
  return CheckTokens(datums, vocab_size, limits);
}

absl::Status ValidateBatch(const std::vector<Datum>& datums, const LossConfig& loss,
                           int64_t vocab_size, const BatchLimits& limits) {
  auto s = ValidateLossConfig(loss);
  if (!s.ok()) return s;
  s = CheckTokens(datums, vocab_size, limits);
  if (!s.ok()) return s;
  const bool rl = loss.is_rl();
  for (size_t d = 0; d < datums.size(); ++d) {
    const Datum& datum = datums[d];
    const size_t n = datum.tokens.size();
    for (const auto& [field, values, required] :
         {std::tuple<const char*, const std::vector<float>*, bool>{"weights", &datum.weights, false},
          {"logprobs", &datum.logprobs, rl || loss.tis_cap > 0},
          {"advantages", &datum.advantages, rl},
          {"ref_logprobs", &datum.ref_logprobs, loss.kl_coef > 0},
          {"old_logprobs", &datum.old_logprobs, false}}) {
      s = CheckFloats(*values, n, d, field, required);
      if (!s.ok()) return s;
      if (values == &datum.weights || values == &datum.advantages) continue;
      for (size_t i = 0; i < values->size(); ++i) {  // log-probabilities
        if ((*values)[i] > 0) {
          return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].", field, "[", i, "]: ",
                                                         (*values)[i], " > 0 is not a log-probability"));
        }
      }
    }
    for (size_t i = 0; i < datum.weights.size(); ++i) {
      if (datum.weights[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].weights[", i, "]: negative"));
      }
      if (datum.weights[i] > kMaxTokenScale) {
        return absl::InvalidArgumentError(
            absl::StrCat("datums[", d, "].weights[", i, "]: ", datum.weights[i], " over ", kMaxTokenScale));
      }
    }
    for (size_t i = 0; i < datum.advantages.size(); ++i) {
      if (std::abs(datum.advantages[i]) > kMaxTokenScale) {
        return absl::InvalidArgumentError(absl::StrCat("datums[", d, "].advantages[", i, "]: ", datum.advantages[i],
                                                       " has magnitude over ", kMaxTokenScale));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

std::vector<size_t> LongestFirst(const std::vector<Datum>& datums) {
  std::vector<size_t> order(datums.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return datums[a].tokens.size() > datums[b].tokens.size();
  });
  return order;
}

}  // namespace

std::vector<std::vector<size_t>> PackIntoMicroBatches(const std::vector<Datum>& datums,
                                                      int64_t max_tokens) {
  std::vector<std::vector<size_t>> out;
  std::vector<int64_t> used;
  for (size_t i : LongestFirst(datums)) {
    const int64_t n = static_cast<int64_t>(datums[i].tokens.size());
    size_t bin = 0;
    while (bin < out.size() && used[bin] + n > max_tokens) ++bin;
    if (bin == out.size()) {
      out.emplace_back();
      used.push_back(0);
    }
    out[bin].push_back(i);
    used[bin] += n;
  }
  return out;
}

std::vector<std::vector<size_t>> SplitIntoMicroBatches(const std::vector<Datum>& datums,
                                                       int64_t max_tokens) {
  // Longest first, so each micro-batch holds datums of similar length and pads little
  // (arrival order mixes short and long datums, and pads the short ones to the long).
  const std::vector<size_t> order = LongestFirst(datums);
  std::vector<std::vector<size_t>> out;
  std::vector<size_t> current;
  int64_t longest = 0;
  for (size_t i : order) {
    const int64_t n = static_cast<int64_t>(datums[i].tokens.size());
    const int64_t new_longest = std::max(longest, n);
    if (!current.empty() && new_longest * static_cast<int64_t>(current.size() + 1) > max_tokens) {
      out.push_back(std::move(current));
      current.clear();
      longest = 0;
    }
    current.push_back(i);
    longest = std::max(longest, n);
  }
  if (!current.empty()) out.push_back(std::move(current));
  return out;
}

absl::StatusOr<ActivationRecompute> ParseActivationRecompute(const std::string& value, const std::string& field) {
  if (value == "auto") return ActivationRecompute::kAuto;
  if (value == "none") return ActivationRecompute::kNone;
  if (value == "selective") return ActivationRecompute::kSelective;
  if (value == "full") return ActivationRecompute::kFull;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", value, "\" is not an activation recomputation (auto, none, selective or full)"));
}

}  // namespace lorastep
