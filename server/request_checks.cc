#include "server/request_checks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace lorastep {

absl::Status CheckActivationRecompute(const std::string& value) {
  if (value.empty()) return absl::OkStatus();
  return ParseActivationRecompute(value, "activation_recompute").status();
}

absl::Status ValidateClientMetrics(const google::protobuf::Map<std::string, double>& m) {
  if (m.size() > 32) return absl::InvalidArgumentError(absl::StrCat("client_metrics: ", m.size(), " entries, at most 32"));
  for (const auto& [name, value] : m) {
    const bool plain = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("_.:/-", c) != nullptr;
                       });
    if (!plain) {
      return absl::InvalidArgumentError(absl::StrCat("client_metrics: name '", absl::CHexEscape(name.substr(0, 80)),
                                                     "' must be 1-64 characters of [A-Za-z0-9_.:/-]"));
    }
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat("client_metrics[", name, "]: ", value, " is not finite"));
    }
  }
  return absl::OkStatus();
}

void AddClientMetrics(const google::protobuf::Map<std::string, double>& m, v1::StepResponse* resp) {
  for (const auto& [name, value] : m) (*resp->mutable_metrics())["client:" + name] = value;
}

// The size from above: per datum a float per target (packed) plus framing, and the metrics.
absl::Status CheckResponseFits(int64_t num_datums, int64_t num_targets, int64_t max_bytes) {
  if (max_bytes == 0) return absl::OkStatus();
  if (max_bytes < 0) return absl::InvalidArgumentError("max_response_bytes: must be >= 0");
  const int64_t bytes = (16 << 10) + 4 * num_targets + 16 * num_datums;
  if (bytes <= max_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "max_response_bytes: the response would take up to ", bytes, " bytes (log-probs of ", num_targets,
      " targets), over the caller's limit of ", max_bytes, "; split the batch or raise the limit (nothing was run)"));
}

absl::Status ApplyWholeBatchTotals(const v1::BatchTotals& whole, BatchTotals* own) {
  for (const auto& [name, value, mine] :
       {std::tuple<const char*, double, double>{"loss_tokens", whole.loss_tokens(), own->loss_tokens},
        {"samples", whole.samples(), own->samples}}) {
    if (!std::isfinite(value) || value < mine || value > 1e15) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch_totals.", name, ": ", value, " must be finite and at least this call's own ", mine));
    }
  }
  own->loss_tokens = whole.loss_tokens();
  own->samples = whole.samples();
  return absl::OkStatus();
}

}  // namespace lorastep
