#include "lib/model/peft_io.h"
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <set>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/status_macros.h"
#include "lib/io/tensor_bytes.h"
#include "nlohmann/json.hpp"

namespace lorastep {

PeftExportOptions PeftOptionsFor(const ModelConfig& model, const LoraConfig& lora, bool expand_experts) {
  PeftExportOptions options{expand_experts, model.moe.num_experts};
  options.linear_attention = model.HasLinearAttention();
  if (model.gpt_oss()) {
    options.expert_parameters = true;
    auto targeted = ResolveLoraTargets(lora);
    options.gate_up_nested = targeted.ok() && (*targeted)[kGateProj] && (*targeted)[kDownProj];
  }
  return options;
}

namespace {

// An expert factor in lorastep's layout (per expert, or shared by the layer's experts: `whole`
// of dim 2) as the one tensor PEFT's target_parameters form holds (PeftExportOptions).
at::Tensor ParameterTargetOf(bool fc1, bool b, const at::Tensor& whole, int64_t num_experts) {
  at::Tensor t = whole;
  if (whole.dim() == 2) t = whole.unsqueeze(0).expand({num_experts, whole.size(0), whole.size(1)});
  const int64_t e = t.size(0);
  if (!b) return t.reshape({-1, t.size(-1)});  // [E, r, in] -> [E * r, in]
  if (fc1) {                                    // [E, 2, I, r] -> [E, 2I (gate, up alternating), r]
    t = t.permute({0, 2, 1, 3}).reshape({e, -1, t.size(-1)});
  }
  return t.permute({1, 2, 0}).reshape({t.size(1), -1});  // [E, out, r] -> [out, r * E]
}

// The inverse for one expert layout: `shape` is the lorastep factor's per-expert shape
// ([E, r, in], [E, 2, I, r] or [E, out, r]).
at::Tensor ParameterTargetToFactor(bool fc1, bool b, const at::Tensor& peft, at::IntArrayRef shape) {
  const int64_t e = shape[0];
  if (!b) return peft.reshape(shape);
  at::Tensor t = peft.reshape({peft.size(0), -1, e}).permute({2, 0, 1});  // [E, out, r]
  if (fc1) t = t.reshape({e, shape[2], 2, shape[3]}).permute({0, 2, 1, 3});
  return t.contiguous();
}

// gpt-oss's target modules as PEFT names them: the module targets (the attention's) and the
// expert parameters (gate_proj, with up_proj, as mlp.experts.gate_up_proj; down_proj as
// mlp.experts.down_proj).
std::pair<std::vector<std::string>, std::vector<std::string>> SplitExpertParameters(
    const std::vector<std::string>& modules) {
  std::vector<std::string> attention, parameters;
  for (const std::string& m : modules) {
    if (m == "gate_proj") parameters.push_back("mlp.experts.gate_up_proj");
    if (m == "down_proj") parameters.push_back("mlp.experts.down_proj");
    if (m != "gate_proj" && m != "up_proj" && m != "down_proj") attention.push_back(m);
  }
  return {attention, parameters};
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> PeftTensorsOf(const std::string& name, const at::Tensor& whole,
                                                              const PeftExportOptions& options) {
  // Expert factors are named "<prefix>mlp.experts.fc1.lora_A.weight" (checkpoint form).
  const size_t at = name.find("mlp.experts.fc");
  if (at == std::string::npos) return {{name, whole}};
  const std::string prefix = name.substr(0, at) + "mlp.experts.";
  const bool fc1 = name.compare(at, 15, "mlp.experts.fc1") == 0;
  const bool b = absl::EndsWith(name, ".lora_B.weight");
  const char* factor = b ? "lora_B.weight" : "lora_A.weight";
  if (options.expert_parameters) {
    const std::string nest = fc1 && options.gate_up_nested ? "base_layer." : "";
    return {{absl::StrCat(prefix, nest, factor), ParameterTargetOf(fc1, b, whole, options.num_experts)}};
  }
  // fc1's A serves gate_proj and up_proj alike; its B holds gate rows then up rows.
  const std::vector<std::string> modules =
      fc1 ? std::vector<std::string>{"gate_proj", "up_proj"} : std::vector<std::string>{"down_proj"};
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (whole.dim() == 2) {  // shared by the layer's experts
    if (!options.expand_experts) {
      for (const auto& m : modules) out.push_back({absl::StrCat(prefix, m, ".", factor), whole});
      return out;
    }
    for (int64_t e = 0; e < options.num_experts; ++e) {
      for (const auto& m : modules) out.push_back({absl::StrCat(prefix, e, ".", m, ".", factor), whole});
    }
    return out;
  }
  for (int64_t e = 0; e < whole.size(0); ++e) {
    for (size_t k = 0; k < modules.size(); ++k) {
      at::Tensor t = fc1 && b ? whole[e][static_cast<int64_t>(k)] : whole[e];  // [E, 2, I, r]
      out.push_back({absl::StrCat(prefix, e, ".", modules[k], ".", factor), t});
    }
  }
  return out;
}

absl::Status ExportPeftAdapter(
    const std::string& folder, const Adapter& adapter, const std::string& base_model_path,
    const std::vector<std::pair<std::string, at::Tensor>>* tensors, const PeftExportOptions& options) {
  if (adapter.full_finetune()) {
    return absl::FailedPreconditionError(
        "export: a rank-0 (full fine-tuning) run has no adapter; save the model instead");
  }
  const LoraConfig& lora = adapter.lora_config();
  LORASTEP_ASSIGN_OR_RETURN(std::vector<std::string> modules, LoraTargetModuleNames(lora, options.linear_attention));
  std::vector<std::string> parameters;  // gpt-oss: the experts as PEFT's target_parameters
  if (options.expert_parameters) std::tie(modules, parameters) = SplitExpertParameters(modules);
  nlohmann::ordered_json config;
  config["peft_type"] = "LORA";
  config["task_type"] = "CAUSAL_LM";
  config["base_model_name_or_path"] = base_model_path;
  config["r"] = lora.rank;
  config["lora_alpha"] = lora.alpha;
  config["lora_dropout"] = lora.dropout;
  config["target_modules"] = modules;
  if (options.expert_parameters) config["target_parameters"] = parameters;
  config["bias"] = "none";
  config["fan_in_fan_out"] = false;
  config["inference_mode"] = true;
  config["init_lora_weights"] = true;
  config["use_rslora"] = false;
  config["use_dora"] = false;
  config["modules_to_save"] = nullptr;
  config["layers_to_transform"] = nullptr;
  bool experts = false;
  for (const Parameter& p : adapter.parameters()) experts = experts || !p.family.empty();
  if (experts) {
    // lorastep's own record of the expert layout ("per_expert" or "shared_outer", and
    // whether shared factors were expanded); PEFT ignores unknown keys.
    config["lorastep_expert_lora"] = lora.expert_lora;
    config["lorastep_experts_expanded"] = options.expand_experts || !lora.shared_outer();
  }
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(folder));
  LORASTEP_RETURN_IF_ERROR(
      WriteStringToFile(folder + "/adapter_config.json", config.dump(2) + "\n"));
  TensorWriteList list;
  std::vector<std::pair<std::string, at::Tensor>> own;
  if (tensors == nullptr) {
    for (const Parameter& p : adapter.parameters()) own.push_back({p.name, p.value});
    tensors = &own;
  }
  for (const auto& [name, whole] : *tensors) {
    for (const auto& [key, t] : PeftTensorsOf(name, whole, options)) {
      LORASTEP_RETURN_IF_ERROR(list.Add(key, t.contiguous()));
    }
  }
  return list.WriteTo(folder + "/adapter_model.safetensors", {{"format", "pt"}});
}

absl::Status ImportPeftAdapter(const std::string& folder, Adapter* adapter, const PeftExportOptions& options) {
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
  // Variants lorastep does not train would load as plain LoRA and silently change the model.
  for (const char* variant : {"use_rslora", "use_dora"}) {
    if (config.contains(variant) && !(config[variant].is_boolean() && !config[variant].get<bool>())) {
      return absl::InvalidArgumentError(absl::StrCat("adapter_config.json: ", variant, ": ",
                                                     config[variant].dump(), " is not supported (plain LoRA only)"));
    }
  }
  // The same modules: a run with fewer targets would drop trained factors without a word.
  LORASTEP_ASSIGN_OR_RETURN(std::vector<std::string> want, LoraTargetModuleNames(lora, options.linear_attention));
  std::set<std::string> have;
  if (options.expert_parameters) {  // gpt-oss: experts through target_parameters
    std::set<std::string> params;
    if (config.contains("target_parameters") && config["target_parameters"].is_array()) {
      for (const auto& m : config["target_parameters"]) {
        if (m.is_string()) params.insert(m.get<std::string>());
      }
    }
    std::vector<std::string> wanted;
    std::tie(want, wanted) = SplitExpertParameters(want);
    const std::set<std::string> want_params(wanted.begin(), wanted.end());
    if (params != want_params) {
      return absl::InvalidArgumentError(absl::StrCat(
          "adapter_config.json: target_parameters: ", config.value("target_parameters", nlohmann::json()).dump(),
          " does not match the run's [", absl::StrJoin(want_params, ", "), "]"));
    }
  }
  if (config.contains("target_modules") && config["target_modules"].is_string()) {
    have.insert(config["target_modules"].get<std::string>());  // PEFT also allows one string
  } else if (config.contains("target_modules") && config["target_modules"].is_array()) {
    for (const auto& m : config["target_modules"]) {
      if (m.is_string()) have.insert(m.get<std::string>());
    }
  }
  if (have == std::set<std::string>{"all-linear"}) {
    have = {};
    for (int s = 0; s < kNumLinearSlots; ++s) {
      if (options.linear_attention || !IsLinearAttentionSlot(s)) have.insert(LinearSlotName(s));
    }
  }
  if (have != std::set<std::string>(want.begin(), want.end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter_config.json: target_modules: ", config.value("target_modules", nlohmann::json()).dump(),
        " does not match the run's [", absl::StrJoin(want, ", "), "]"));
  }
  LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile file,
                            SafetensorsFile::Open(folder + "/adapter_model.safetensors"));
  auto read = [&](const std::string& key, at::IntArrayRef want) -> absl::StatusOr<at::Tensor> {
    auto entry = file.Find(key);
    if (!entry.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": missing tensor '", key, "'"));
    }
    if (!want.equals((*entry)->shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor '", key, "': shape mismatch: expected [", absl::StrJoin(want, ", "),
          "], got [", absl::StrJoin((*entry)->shape, ", "), "]"));
    }
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, TensorFromEntry(**entry));
    if (!at::isfinite(t.to(at::kFloat)).all().item<bool>()) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", key, "': holds non-finite values"));
    }
    return t;
  };
  // Copies that must agree (fc1's A under gate_proj and up_proj; an expanded shared factor).
  auto same = [&](const at::Tensor& a, const at::Tensor& b, const std::string& key) -> absl::Status {
    if (at::equal(a, b)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", key,
                                                   "' differs from the copy it must equal (fc1's A is "
                                                   "shared by gate_proj and up_proj; a shared-outer "
                                                   "factor by every expert)"));
  };
  // Read and check everything first; only then write into the live parameters.
  std::vector<at::Tensor> staged;
  for (const Parameter& p : adapter->parameters()) {
    if (p.family.empty()) {
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, read(p.name, p.value.sizes()));
      staged.push_back(t);
      continue;
    }
    const bool shared = p.value.dim() == 2;
    if (options.expert_parameters) {  // one PEFT tensor per factor; per-expert layout inside
      const bool fc1 = p.family == "fc1", b = absl::EndsWith(p.name, ".lora_B.weight");
      const auto key = PeftTensorsOf(p.name, p.value, options).front();
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, read(key.first, key.second.sizes()));
      std::vector<int64_t> per_expert(p.value.sizes().begin(), p.value.sizes().end());
      if (shared) per_expert.insert(per_expert.begin(), options.num_experts);
      at::Tensor value = ParameterTargetToFactor(fc1, b, t, per_expert);
      if (shared) {  // every expert's copy must be the one shared factor
        for (int64_t e = 1; e < value.size(0); ++e) LORASTEP_RETURN_IF_ERROR(same(value[e], value[0], key.first));
        value = value[0];
      }
      staged.push_back(value);
      continue;
    }
    // An expert factor: its per-module keys, in (expert, module) order.
    PeftExportOptions compact;
    auto keys = PeftTensorsOf(p.name, p.value, compact);
    if (shared && !file.Find(keys[0].first).ok()) {  // the expanded form: one copy per expert
      PeftExportOptions expanded{true, 0};
      while (file.Find(PeftTensorsOf(p.name, p.value, PeftExportOptions{true, expanded.num_experts + 1})
                           .back().first).ok()) {
        ++expanded.num_experts;
      }
      if (expanded.num_experts == 0) expanded.num_experts = 1;  // reports the missing key
      keys = PeftTensorsOf(p.name, p.value, expanded);
    }
    std::vector<at::Tensor> parts;
    for (const auto& [key, like] : keys) {
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, read(key, like.sizes()));
      parts.push_back(t);
    }
    const bool fc1_b = p.family == "fc1" && absl::EndsWith(p.name, ".lora_B.weight");
    const size_t per_expert = p.family == "fc1" ? 2 : 1;  // gate and up, or down
    at::Tensor value;
    if (shared) {
      for (size_t i = 1; i < parts.size(); ++i) LORASTEP_RETURN_IF_ERROR(same(parts[i], parts[0], keys[i].first));
      value = parts[0];
    } else if (fc1_b) {
      std::vector<at::Tensor> experts;
      for (size_t i = 0; i < parts.size(); i += 2) experts.push_back(at::stack({parts[i], parts[i + 1]}));
      value = at::stack(experts);
    } else {
      std::vector<at::Tensor> experts;
      for (size_t i = 0; i < parts.size(); i += per_expert) {
        if (per_expert == 2) LORASTEP_RETURN_IF_ERROR(same(parts[i + 1], parts[i], keys[i + 1].first));
        experts.push_back(parts[i]);
      }
      value = at::stack(experts);
    }
    staged.push_back(value);
  }
  at::NoGradGuard no_grad;
  auto& params = adapter->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].value.copy_(staged[i]);
  return absl::OkStatus();
}

}  // namespace lorastep
