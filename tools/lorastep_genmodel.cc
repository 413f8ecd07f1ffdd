// Writes a randomly initialized Qwen2-shaped model in Hugging Face layout.
//   lorastep_genmodel --preset tiny|small|qwen2.5-0.5b --out DIR [--seed N] [--dtype D] [--shards K]
#include <cstdlib>
#include <iostream>
#include <string>

#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"

int main(int argc, char** argv) {
  std::string preset = "tiny", out, dtype;
  uint64_t seed = 0;
  int shards = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--preset") preset = value;
    else if (flag == "--out") out = value;
    else if (flag == "--seed") seed = std::strtoull(value.c_str(), nullptr, 10);
    else if (flag == "--dtype") dtype = value;
    else if (flag == "--shards") shards = std::atoi(value.c_str());
    else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  if (out.empty()) {
    std::cerr << "usage: lorastep_genmodel --preset NAME --out DIR [--seed N] [--dtype D] [--shards K]\n";
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
