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

// Writes exactly the trained factors (in their training dtype). `tensors`: the whole
// adapter by PEFT key when this rank holds only part of it (tensor slices, one pipeline
// stage); else the adapter's own values.
absl::Status ExportPeftAdapter(
    const std::string& folder, const Adapter& adapter, const std::string& base_model_path,
    const std::vector<std::pair<std::string, at::Tensor>>* tensors = nullptr);

// Loads factors into a LoRA adapter of the same rank, alpha and targets. Mismatched config,
// a missing key or a wrong shape is INVALID_ARGUMENT naming it; on error nothing changes.
absl::Status ImportPeftAdapter(const std::string& folder, Adapter* adapter);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_PEFT_IO_H_
