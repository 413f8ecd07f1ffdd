// The config.json readers and writers of the families with keys of their own (gpt-oss,
// Qwen3.5), for model_config.cc.
#ifndef LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_
#define LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_

#include <string>

#include "absl/status/status.h"
#include "lib/model/model_config.h"
#include "nlohmann/json.hpp"

namespace lorastep {

// Qwen3.5's hybrid layers: Gated DeltaNet sizes, the layer pattern, partial RoPE.
absl::Status ValidateLinearAttention(const ModelConfig& c);
// Qwen3.5's own keys into `c` (see the definition for the defaults).
absl::Status ReadQwen35(const nlohmann::json& j, ModelConfig* c);
// architectures, model_type and the shape's keys every family's config.json starts with.
nlohmann::ordered_json ShapeKeys(const ModelConfig& c, const char* architecture);
// The config.json transformers' class of the family loads.
std::string GptOssConfigToJson(const ModelConfig& c);
std::string Qwen35ConfigToJson(const ModelConfig& c);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_
