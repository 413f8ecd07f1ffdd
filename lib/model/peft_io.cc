#include "lib/model/peft_io.h"
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/status_macros.h"
#include "lib/io/tensor_bytes.h"
#include "nlohmann/json.hpp"

namespace lorastep {

absl::Status ExportPeftAdapter(
    const std::string& folder, const Adapter& adapter, const std::string& base_model_path,
    const std::vector<std::pair<std::string, at::Tensor>>* tensors) {
  if (adapter.full_finetune()) {
    return absl::FailedPreconditionError(
        "export: a rank-0 (full fine-tuning) run has no adapter; save the model instead");
  }
  const LoraConfig& lora = adapter.lora_config();
  LORASTEP_ASSIGN_OR_RETURN(auto targeted, ResolveLoraTargets(lora));
  std::vector<std::string> modules;
  for (int s = 0; s < kNumLinearSlots; ++s) {
    if (targeted[s]) modules.push_back(LinearSlotName(s));
  }
  nlohmann::ordered_json config;
  config["peft_type"] = "LORA";
  config["task_type"] = "CAUSAL_LM";
  config["base_model_name_or_path"] = base_model_path;
  config["r"] = lora.rank;
  config["lora_alpha"] = lora.alpha;
  config["lora_dropout"] = lora.dropout;
  config["target_modules"] = modules;
  config["bias"] = "none";
  config["fan_in_fan_out"] = false;
  config["inference_mode"] = true;
  config["init_lora_weights"] = true;
  config["use_rslora"] = false;
  config["use_dora"] = false;
  config["modules_to_save"] = nullptr;
  config["layers_to_transform"] = nullptr;
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(folder));
  LORASTEP_RETURN_IF_ERROR(
      WriteStringToFile(folder + "/adapter_config.json", config.dump(2) + "\n"));
  TensorWriteList list;
  if (tensors != nullptr) {
    for (const auto& [name, t] : *tensors) LORASTEP_RETURN_IF_ERROR(list.Add(name, t));
  } else {
    for (const Parameter& p : adapter.parameters()) LORASTEP_RETURN_IF_ERROR(list.Add(p.name, p.value));
  }
  return list.WriteTo(folder + "/adapter_model.safetensors", {{"format", "pt"}});
}

absl::Status ImportPeftAdapter(const std::string& folder, Adapter* adapter) {
  if (adapter->full_finetune()) {
    return absl::FailedPreconditionError("import: a rank-0 run has no adapter to load into");
  }
  LORASTEP_ASSIGN_OR_RETURN(std::string text, ReadFileToString(folder + "/adapter_config.json"));
  nlohmann::json config = nlohmann::json::parse(text, nullptr, false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError("adapter_config.json: not a JSON object");
  }
  const LoraConfig& lora = adapter->lora_config();
  if (!config.contains("r") || config["r"] != lora.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter_config.json: r: ", config.value("r", nlohmann::json()).dump(),
                     " does not match the run's rank ", lora.rank));
  }
  if (!config.contains("lora_alpha") || !config["lora_alpha"].is_number() ||
      std::abs(config["lora_alpha"].get<double>() - lora.alpha) > 1e-9) {
    return absl::InvalidArgumentError(
        absl::StrCat("adapter_config.json: lora_alpha does not match the run's ", lora.alpha));
  }
  LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile file,
                            SafetensorsFile::Open(folder + "/adapter_model.safetensors"));
  // Read and check everything first; only then write into the live parameters.
  std::vector<at::Tensor> staged;
  for (const Parameter& p : adapter->parameters()) {
    auto entry = file.Find(p.name);
    if (!entry.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": missing tensor '", p.name, "'"));
    }
    std::vector<int64_t> want(p.value.sizes().begin(), p.value.sizes().end());
    if ((*entry)->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor '", p.name, "': shape mismatch: expected [",
          absl::StrJoin(want, ", "), "], got [", absl::StrJoin((*entry)->shape, ", "), "]"));
    }
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, TensorFromEntry(**entry));
    if (!at::isfinite(t.to(at::kFloat)).all().item<bool>()) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", p.name,
                                                     "': holds non-finite values"));
    }
    staged.push_back(t);
  }
  at::NoGradGuard no_grad;
  auto& params = adapter->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].value.copy_(staged[i]);
  return absl::OkStatus();
}

}  // namespace lorastep
