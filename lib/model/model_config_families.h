// The config.json readers and writers of the families with keys of their own (gpt-oss,
// Qwen3.5), for model_config.cc.
#ifndef LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_
#define LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/model/model_config.h"
#include "nlohmann/json.hpp"

namespace lorastep {

// Qwen3.5's hybrid layers: Gated DeltaNet sizes, the layer pattern, partial RoPE.
absl::Status ValidateLinearAttention(const ModelConfig& c);
// Qwen3.5's own keys into `c` (see the definition for the defaults).
absl::Status ReadQwen35(const nlohmann::json& j, ModelConfig* c);
// architectures, model_type and the shape's keys every family's config.json starts with.
nlohmann::ordered_json ShapeKeys(const ModelConfig& c, const char* architecture);
// The text model's config of a Qwen3.5 vision-language config.json (model_type qwen3_5 or
// qwen3_5_moe): its text_config, with the wrapper's tie_word_embeddings and dtype where the
// text config lacks them. The wrapper's other keys are the vision tower's and its token ids
// (refused by name if not one of them).
absl::StatusOr<nlohmann::json> TextConfigOfVl(const nlohmann::json& j);
// The config.json transformers' class of the family loads.
std::string GptOssConfigToJson(const ModelConfig& c);
std::string Qwen35ConfigToJson(const ModelConfig& c);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_MODEL_CONFIG_FAMILIES_H_
