// Model shapes by name, for the generator (lorastep_genmodel), the demo and the tests.
#ifndef LORASTEP_TOOLS_MODEL_PRESETS_H_
#define LORASTEP_TOOLS_MODEL_PRESETS_H_

#include <string>

#include "absl/status/statusor.h"
#include "lib/model/model_config.h"

namespace lorastep {

// Named shapes: "tiny" (fast CPU tests), "small" (CPU demo), "qwen2.5-0.5b" (the miles
// example's shape: 24 layers, H 896, FFN 4864, 14 heads, 2 KV groups, vocab 151936);
// MoE: "tiny-moe" (Qwen2-MoE with a shared expert, 4 experts, top-2), "tiny-qwen3-moe"
// (q/k norms, head_dim 16 != 32/4, layer 0 dense), and
// "qwen3-30b-a3b-reduced" (Qwen3-30B-A3B's width, 128 experts, top-8; 4 layers).
// Qwen3 dense: "tiny-qwen3", "qwen3-0.6b", "qwen3-8b"; Llama 3: "tiny-llama" (llama3 RoPE),
// "llama-3.2-1b" (tied), "llama-3.1-8b"; sliding-window attention: "tiny-qwen2-swa" (tiny,
// its second layer in a window of 4); gpt-oss: "tiny-gpt-oss" (4 experts, top-2, sinks,
// layer 0 in a window of 4, YaRN) and "gpt-oss-20b-reduced" (gpt-oss-20b's widths, 4 layers);
// Qwen3.5: "tiny-qwen3.5" (a Gated DeltaNet layer, then gated full attention) and
// "tiny-qwen3.5-moe" (the same with 4 experts, top-2, and a gated shared expert), "qwen3.5-9b"
// (Qwen3_5TextConfig's default shape: 32 layers, every fourth full attention).
absl::StatusOr<ModelConfig> ModelConfigPreset(const std::string& name);

}  // namespace lorastep

#endif  // LORASTEP_TOOLS_MODEL_PRESETS_H_
