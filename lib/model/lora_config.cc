#include "lib/model/lora_config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {
constexpr const char* kSlotNames[kNumLinearSlots] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"};
constexpr const char* kHeadName = "lm_head";
// The Gated DeltaNet projections of a model's linear-attention layers, where it has them (a
// group like all-linear: nothing on a model without such layers). Tinker's train_attn uses
// it, so that attention means every layer's token mixer.
constexpr const char* kLinearAttentionGroup = "linear_attn";
constexpr const char* kSlotPaths[kNumLinearSlots] = {
    "self_attn.q_proj",      "self_attn.k_proj",    "self_attn.v_proj",    "self_attn.o_proj",
    "mlp.gate_proj",         "mlp.up_proj",         "mlp.down_proj",       "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.out_proj"};
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
    if (name == kHeadName) continue;
    if (name == "all-linear") {
      targeted.fill(true);
      continue;
    }
    if (name == kLinearAttentionGroup) {
      for (int s = kInProjQkv; s < kNumLinearSlots; ++s) targeted[s] = true;
      continue;
    }
    if (name == "gate_up_proj") {  // gpt-oss's fused expert projection: gate_proj and up_proj
      targeted[kGateProj] = targeted[kUpProj] = true;
      continue;
    }
    bool found = false;
    for (int s = 0; s < kNumLinearSlots; ++s) {
      if (name == kSlotNames[s]) targeted[s] = found = true;
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.target_modules[", i, "]: unknown module '", name,
                       "' (expected all-linear, q/k/v/o/gate/up/down_proj, gate_up_proj, "
                       "in_proj_qkv/z/b/a, out_proj, linear_attn or lm_head)"));
    }
  }
  return targeted;
}

bool LoraTargetsHead(const LoraConfig& config) {
  for (const auto& name : config.target_modules) {
    if (name == kHeadName) return true;
  }
  return false;
}

absl::StatusOr<std::vector<std::string>> LoraTargetModuleNames(const LoraConfig& config, bool linear_attention) {
  std::array<bool, kNumLinearSlots> targeted{};
  // lm_head alone targets no decoder linear; ResolveLoraTargets reports unknown names.
  LORASTEP_ASSIGN_OR_RETURN(targeted, ResolveLoraTargets(config));
  std::vector<std::string> names;
  for (int s = 0; s < kNumLinearSlots; ++s) {
    if (targeted[s] && (linear_attention || !IsLinearAttentionSlot(s))) names.push_back(kSlotNames[s]);
  }
  if (LoraTargetsHead(config)) names.push_back(kHeadName);
  return names;
}

absl::StatusOr<std::vector<std::string>> TargetsFromSwitches(bool train_attn, bool train_mlp,
                                                             bool train_unembed) {
  std::vector<std::string> names;
  if (train_attn) names.insert(names.end(), {"q_proj", "k_proj", "v_proj", "o_proj", kLinearAttentionGroup});
  if (train_mlp) names.insert(names.end(), {"gate_proj", "up_proj", "down_proj"});
  if (train_unembed) names.push_back(kHeadName);
  if (names.empty()) {
    return absl::InvalidArgumentError(
        "lora.train_attn, lora.train_mlp, lora.train_unembed: all false, nothing to train");
  }
  return names;
}

std::optional<TinkerSwitches> SwitchesFromTargets(const std::vector<std::string>& target_modules) {
  const std::set<std::string> attn = {"q_proj", "k_proj", "v_proj", "o_proj"};
  const std::set<std::string> mlp = {"gate_proj", "up_proj", "down_proj"};
  std::set<std::string> names;
  bool linear = false;  // the linear-attention projections, as the group or all five by name
  for (const std::string& name : target_modules) {
    if (name == "all-linear") {
      names.insert(attn.begin(), attn.end());
      names.insert(mlp.begin(), mlp.end());
      linear = true;
    } else if (name == kLinearAttentionGroup) {
      linear = true;
    } else {
      names.insert(name);
    }
  }
  int named_linear = 0;
  for (int s = kInProjQkv; s < kNumLinearSlots; ++s) named_linear += names.erase(kSlotNames[s]) > 0 ? 1 : 0;
  if (named_linear != 0 && named_linear != kNumLinearSlots - kInProjQkv) return std::nullopt;  // some of them
  linear = linear || named_linear > 0;
  auto all_in = [&](const std::set<std::string>& group) {
    return std::all_of(group.begin(), group.end(), [&](const std::string& n) { return names.count(n) > 0; });
  };
  auto none_in = [&](const std::set<std::string>& group) {
    return std::none_of(group.begin(), group.end(), [&](const std::string& n) { return names.count(n) > 0; });
  };
  if (!(all_in(attn) || none_in(attn)) || !(all_in(mlp) || none_in(mlp))) return std::nullopt;
  TinkerSwitches s;
  s.train_attn = all_in(attn);
  s.train_mlp = all_in(mlp);
  s.train_unembed = names.count(kHeadName) > 0;
  const size_t expected = (s.train_attn ? attn.size() : 0) + (s.train_mlp ? mlp.size() : 0) + (s.train_unembed ? 1 : 0);
  if (names.size() != expected || expected == 0) return std::nullopt;  // a name outside the groups
  if (linear && !s.train_attn) return std::nullopt;                     // a token mixer without attention
  return s;
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
