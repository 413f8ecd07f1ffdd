#include "server/tinker_losses.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/training/loss_config.h"

namespace lorastep {
namespace {

absl::Status OutOfRange(const std::string& key, double value, const std::string& range) {
  return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": ", value, " is not in ", range));
}

}  // namespace

absl::StatusOr<v1::LossConfig> LossConfigFromTinker(const std::string& loss_fn,
                                                    const std::map<std::string, double>& loss_fn_config) {
  std::vector<std::string> keys;
  if (loss_fn == "ppo" || loss_fn == "cispo") {
    keys = {"clip_low_threshold", "clip_high_threshold"};
  } else if (loss_fn == "dro") {
    keys = {"beta"};
  } else if (loss_fn != "cross_entropy" && loss_fn != "importance_sampling") {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss_fn: unknown '", loss_fn, "' (cross_entropy, importance_sampling, ppo, cispo, dro)"));
  }
  for (const auto& [key, value] : loss_fn_config) {
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": not a key of ", loss_fn,
                                                     keys.empty() ? " (it takes none)" : absl::StrCat(
                                                         " (", absl::StrJoin(keys, ", "), ")")));
    }
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat("loss_fn_config.", key, ": not finite"));
    }
  }
  const auto get = [&](const std::string& key, double fallback) {
    auto it = loss_fn_config.find(key);
    return it == loss_fn_config.end() ? fallback : it->second;
  };
  v1::LossConfig c;
  c.set_loss_fn(loss_fn);
  c.set_normalization("sum");  // Tinker's token losses are sums
  if (loss_fn == "ppo" || loss_fn == "cispo") {
    const double lo = get("clip_low_threshold", 0.8), hi = get("clip_high_threshold", 1.2);
    if (loss_fn == "ppo") {
      // -min(r A, clip(r, lo, hi) A) is lorastep's ppo with the ratio clipped to [1 - eps_low, 1 + eps_high].
      if (lo <= 0 || lo > 1) return OutOfRange("clip_low_threshold", lo, "(0, 1]");
      if (hi < 1 || hi > 1 + kMaxClipBound) return OutOfRange("clip_high_threshold", hi, absl::StrCat("[1, ", 1 + kMaxClipBound, "]"));
      c.set_clip_eps_low(1 - lo);
      c.set_clip_eps_high(hi - 1);
    } else {
      if (lo < 0) return OutOfRange("clip_low_threshold", lo, "[0, clip_high_threshold)");
      if (hi <= lo || hi > kMaxClipBound) {
        return OutOfRange("clip_high_threshold", hi, absl::StrCat("(clip_low_threshold, ", kMaxClipBound, "]"));
      }
      c.set_cispo_ratio_low(lo);
      c.set_cispo_ratio_high(hi);
    }
  } else if (loss_fn == "dro") {
    const double beta = get("beta", 0.05);
    if (beta < 0 || beta > kMaxLossCoefficient) return OutOfRange("beta", beta, absl::StrCat("[0, ", kMaxLossCoefficient, "]"));
    c.set_dro_beta(beta);
  }
  return c;
}

}  // namespace lorastep
