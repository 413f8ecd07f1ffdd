#include "lib/model/lora_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {
constexpr const char* kSlotNames[kNumLinearSlots] = {"q_proj",    "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"};
constexpr const char* kSlotPaths[kNumLinearSlots] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
}  // namespace

const char* LinearSlotName(int slot) { return kSlotNames[slot]; }
const char* LinearSlotModulePath(int slot) { return kSlotPaths[slot]; }

absl::StatusOr<std::array<bool, kNumLinearSlots>> ResolveLoraTargets(const LoraConfig& config) {
  std::array<bool, kNumLinearSlots> targeted{};
  if (config.target_modules.empty()) {
    return absl::InvalidArgumentError("lora.target_modules: empty");
  }
  for (size_t i = 0; i < config.target_modules.size(); ++i) {
    const std::string& name = config.target_modules[i];
    if (name == "all-linear") {
      targeted.fill(true);
      continue;
    }
    bool found = false;
    for (int s = 0; s < kNumLinearSlots; ++s) {
      if (name == kSlotNames[s]) targeted[s] = found = true;
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.target_modules[", i, "]: unknown module '", name,
                       "' (expected all-linear or q/k/v/o/gate/up/down_proj)"));
    }
  }
  return targeted;
}

absl::Status ValidateLoraConfig(const LoraConfig& config) {
  if (config.rank < 0) return absl::InvalidArgumentError("lora.rank: must be >= 0");
  if (config.rank > kMaxLoraRank) {
    return absl::InvalidArgumentError(absl::StrCat("lora.rank: ", config.rank, " exceeds the limit of ", kMaxLoraRank));
  }
  if (config.rank > 0 && !(config.alpha > 0 && config.alpha <= kMaxLoraAlpha)) {
    return absl::InvalidArgumentError("lora.alpha: must be in (0, 1e6]");
  }
  if (!(config.dropout >= 0.0 && config.dropout < 1.0)) {
    return absl::InvalidArgumentError("lora.dropout: must be in [0, 1)");
  }
  if (config.expert_lora != "per_expert" && config.expert_lora != "shared_outer") {
    return absl::InvalidArgumentError(absl::StrCat("lora.expert_lora: unknown '", config.expert_lora,
                                                   "' (expected per_expert or shared_outer)"));
  }
  if (config.rank > 0) return ResolveLoraTargets(config).status();
  return absl::OkStatus();
}

}  // namespace lorastep
