// Writes a randomly initialized Qwen2-shaped model in Hugging Face layout.
//   lorastep_genmodel --preset NAME (lib/model/model_config.h) --out DIR [--seed N] [--dtype D] [--shards K]
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "lib/flags_util.h"
#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"
#include "tools/model_presets.h"

ABSL_FLAG(std::string, preset, "tiny", "model shape: tiny, small, qwen2.5-0.5b, tiny-qwen3, tiny-qwen2-swa, qwen3-0.6b, qwen3-8b, tiny-llama, llama-3.2-1b, llama-3.1-8b, tiny-moe, tiny-qwen3-moe, qwen3-30b-a3b-reduced (lib/model/model_config.h)");
ABSL_FLAG(std::string, out, "", "folder to write (config.json + safetensors); required");
ABSL_FLAG(uint64_t, seed, 0, "seed of the random weights");
ABSL_FLAG(std::string, dtype, "", "torch_dtype of the written weights (default: the preset's)");
ABSL_FLAG(int, shards, 1, "safetensors files to split the weights over");

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv,
                                   "lorastep_genmodel --preset NAME --out DIR [--seed N] [--dtype D] [--shards K]");
  const std::string preset = absl::GetFlag(FLAGS_preset), out = absl::GetFlag(FLAGS_out),
                    dtype = absl::GetFlag(FLAGS_dtype);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int shards = absl::GetFlag(FLAGS_shards);
  if (out.empty()) {
    std::cerr << "lorastep_genmodel: --out is required (see --help)\n";
    return 2;
  }
  auto config = lorastep::ModelConfigPreset(preset);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 2;
  }
  if (!dtype.empty()) config->torch_dtype = dtype;
  auto status = lorastep::SaveModel(out, *config, lorastep::RandomModelWeights(*config, seed), shards);
  if (!status.ok()) {
    std::cerr << status << "\n";
    return 1;
  }
  std::cout << "wrote " << preset << " (" << config->TotalParameterCount() << " parameters) to "
            << out << "\n";
  return 0;
}
