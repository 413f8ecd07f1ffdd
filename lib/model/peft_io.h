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
struct PeftExportOptions {
  bool expand_experts = false;
  int64_t num_experts = 0;  // the model's routed experts (for expanding shared factors)
};

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
absl::Status ImportPeftAdapter(const std::string& folder, Adapter* adapter);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_PEFT_IO_H_
