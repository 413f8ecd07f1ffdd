// PEFT adapter folders: adapter_config.json + adapter_model.safetensors with PEFT's key names
// (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight), which vLLM, SGLang and
// PEFT load without merging.
#ifndef LORASTEP_LIB_MODEL_PEFT_IO_H_
#define LORASTEP_LIB_MODEL_PEFT_IO_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "lib/model/adapter.h"

namespace lorastep {

// Routed-expert factors (MoE) in PEFT form, one module per expert, as transformers'
// save_pretrained names the experts (docs/API.md):
//   ...layers.N.mlp.experts.{e}.gate_proj.lora_A.weight  [r, H]   (fc1's A, also up_proj's)
//   ...layers.N.mlp.experts.{e}.gate_proj.lora_B.weight  [I, r]   (fc1's B, gate rows)
//   ...layers.N.mlp.experts.{e}.up_proj.lora_B.weight    [I, r]   (fc1's B, up rows)
//   ...layers.N.mlp.experts.{e}.down_proj.lora_A.weight  [r, I]
//   ...layers.N.mlp.experts.{e}.down_proj.lora_B.weight  [H, r]
// A shared-outer adapter writes its shared factors once, without the expert index
// (mlp.experts.gate_proj.lora_A, mlp.experts.up_proj.lora_A, mlp.experts.down_proj.lora_B),
// unless `expand_experts`: then every expert gets its own copy (a plain per-expert adapter
// for servers that need one).
// gpt-oss keeps its experts as stacked parameters, which PEFT adapts with target_parameters
// (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`): one lora_A / lora_B pair per stacked
// parameter, on the experts module (gate_up_proj's one level down, under base_layer, when
// down_proj is targeted too, as PEFT nests the two wrappers):
//   ...layers.N.mlp.experts[.base_layer].lora_A.weight  [E * r, in]   row e * r + k: A_e[k]
//   ...layers.N.mlp.experts[.base_layer].lora_B.weight  [out, r * E]  column k * E + e: B_e[:, k]
// (in, out: H and 2I for gate_up_proj, whose B rows interleave gate and up as its columns
// do; I and H for down_proj). Shared-outer factors are written once per expert.
struct PeftExportOptions {
  bool expand_experts = false;
  int64_t num_experts = 0;  // the model's routed experts (for expanding shared factors)
  bool expert_parameters = false;  // gpt-oss: the target_parameters form above
  bool gate_up_nested = false;     // expert_parameters with down_proj targeted too
  bool linear_attention = false;   // Qwen3.5: Gated DeltaNet projections among the targets
};
// The export options of an adapter over `model` (the gpt-oss form where it applies).
PeftExportOptions PeftOptionsFor(const ModelConfig& model, const LoraConfig& lora, bool expand_experts);

// The PEFT tensors of the whole value of the parameter named `name` (checkpoint name):
// itself for a dense LoRA factor; per-expert modules for an expert factor.
std::vector<std::pair<std::string, at::Tensor>> PeftTensorsOf(const std::string& name, const at::Tensor& whole,
                                                              const PeftExportOptions& options);

// Writes exactly the trained factors (in their training dtype). `tensors`: the whole
// adapter by checkpoint name when this rank holds only part of it (tensor slices, expert
// slices, one pipeline stage); else the adapter's own values.
absl::Status ExportPeftAdapter(
    const std::string& folder, const Adapter& adapter, const std::string& base_model_path,
    const std::vector<std::pair<std::string, at::Tensor>>* tensors = nullptr,
    const PeftExportOptions& options = {});

// Loads factors into a LoRA adapter of the same rank, alpha and targets (whole tensors: world
// size 1). Expert factors load from either form above; an expanded shared factor must be the
// same for every expert. Mismatched config, a missing key, a wrong shape or non-finite
// values are INVALID_ARGUMENT naming it; on error nothing changes.
// `options`: PeftOptionsFor the run's model (which expert form to read).
absl::Status ImportPeftAdapter(const std::string& folder, Adapter* adapter, const PeftExportOptions& options = {});

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_PEFT_IO_H_
