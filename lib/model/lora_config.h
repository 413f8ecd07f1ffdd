// Which linears get LoRA adapters, and how large. rank 0 means full fine-tuning.
#ifndef LORASTEP_LIB_MODEL_LORA_CONFIG_H_
#define LORASTEP_LIB_MODEL_LORA_CONFIG_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lorastep {

// The linears of a decoder layer, in PEFT/HF module-name order: the seven of a Qwen2 layer,
// then the five of Qwen3.5's linear-attention (Gated DeltaNet) layers, which have them in
// place of q/k/v/o.
enum LinearSlot {
  kQProj = 0, kKProj, kVProj, kOProj, kGateProj, kUpProj, kDownProj,
  kInProjQkv, kInProjZ, kInProjB, kInProjA, kOutProj
};
constexpr int kNumLinearSlots = 12;
inline bool IsMlpSlot(int slot) { return slot >= kGateProj && slot <= kDownProj; }
inline bool IsLinearAttentionSlot(int slot) { return slot >= kInProjQkv; }
// "q_proj", ... ; and the module path inside a layer: "self_attn.q_proj", "mlp.gate_proj".
const char* LinearSlotName(int slot);
const char* LinearSlotModulePath(int slot);

struct LoraConfig {
  int64_t rank = 32;        // 0 = full fine-tuning (every weight trainable)
  double alpha = 32.0;      // scale = alpha / rank
  double dropout = 0.0;     // on the LoRA branch's input, training only
  // Module names ("q_proj", ..., "lm_head") or "all-linear" (every linear of the decoder
  // layers: PEFT's meaning, which leaves the LM head out). "lm_head" puts LoRA on the
  // unembedding (Tinker's train_unembed); it is exported under PEFT's key
  // base_model.model.lm_head.lora_{A,B}.weight.  "gate_up_proj" (gpt-oss's fused expert
  // projection) is gate_proj and up_proj together.
  std::vector<std::string> target_modules = {"all-linear"};
  // LoRA on the routed experts of a MoE layer (gate_proj + up_proj = fc1, down_proj = fc2):
  //  "per_expert":   A_e and B_e for every expert, on fc1 and fc2.
  //  "shared_outer": fc1's A shared by the layer's experts, B per expert; fc2's A per
  //                  expert, B shared (Megatron-Bridge's shared-outer grouped-expert adapter).
  std::string expert_lora = "per_expert";

  double scale() const { return rank > 0 ? alpha / static_cast<double>(rank) : 0.0; }
  bool full_finetune() const { return rank == 0; }
  bool shared_outer() const { return expert_lora == "shared_outer"; }
};

// Bounds: rank <= 1024 (a larger one only costs memory), alpha finite in (0, 1e6].
constexpr int64_t kMaxLoraRank = 1024;
constexpr double kMaxLoraAlpha = 1e6;

// Errors name the field: "lora.rank: must be >= 0", "lora.target_modules[2]: unknown 'foo'".
absl::Status ValidateLoraConfig(const LoraConfig& config);
// targeted[slot] is true when that linear gets an adapter.
absl::StatusOr<std::array<bool, kNumLinearSlots>> ResolveLoraTargets(const LoraConfig& config);
// Whether the LM head gets an adapter ("lm_head" among the targets).
bool LoraTargetsHead(const LoraConfig& config);
// The targeted modules as PEFT's adapter_config.json lists them, in a fixed order
// (q_proj .. down_proj, then lm_head).
// `linear_attention`: the model has Gated DeltaNet layers (their five projections count as
// targets of "all-linear" and are listed); else they are left out.
absl::StatusOr<std::vector<std::string>> LoraTargetModuleNames(const LoraConfig& config,
                                                               bool linear_attention = false);

// Tinker's switches (train_attn, train_mlp, train_unembed) as target modules: attention is
// every layer's token mixer, q/k/v/o_proj and the group linear_attn (the Gated DeltaNet
// projections where the model has them), the MLP gate/up/down_proj (a MoE layer's experts),
// the unembedding lm_head.
// INVALID_ARGUMENT naming the field when nothing would be trained.
absl::StatusOr<std::vector<std::string>> TargetsFromSwitches(bool train_attn, bool train_mlp,
                                                             bool train_unembed);

// The inverse, for a run's or checkpoint's resolved target modules: the switches when the
// targets are exactly a union of those groups ("all-linear" is attention and the MLP; the
// linear-attention projections, by group or all five by name, belong to attention), else
// nullopt (targets Tinker's switches cannot express, such as q_proj alone).
struct TinkerSwitches {
  bool train_attn = false, train_mlp = false, train_unembed = false;
};
std::optional<TinkerSwitches> SwitchesFromTargets(const std::vector<std::string>& target_modules);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LORA_CONFIG_H_
