// The cost of the gradient finalizer's post-reduction check on one rank: the SHA-256 of
// every gradient bucket that rank compares with its replicas (lib/io/digest.h, on the
// device when the CUDA kernels are built), for the LoRA adapter of a model on rank 0 of a
// tp x pp x dp layout, built as the worker builds it (Adapter::CreateLora on the rank's
// ModelShard). The world all-gather of the digests is not included (one GPU). Prints and
// writes the median time of one check over --repeats, after two warm-up checks.
//   digest_cost --model_dir DIR --lora_rank 32 --tp 2 --out digest.json
#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_stats.h"
#include "lib/flags_util.h"
#include "lib/io/digest.h"
#include "lib/model/adapter.h"
#include "lib/model/model_config.h"
#include "lib/parallel/parallel_layout.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model_dir, "", "model folder with config.json");
ABSL_FLAG(int64_t, lora_rank, 32, "LoRA rank (all linears)");
ABSL_FLAG(int, tp, 2, "tensor-parallel size");
ABSL_FLAG(int, pp, 1, "pipeline-parallel size");
ABSL_FLAG(int, dp, 1, "data-parallel size");
ABSL_FLAG(int, repeats, 20, "timed checks");
ABSL_FLAG(std::string, device, "cuda", "cuda or cpu");
ABSL_FLAG(std::string, out, "", "JSON output file");
ABSL_FLAG(std::string, machine, "", "recorded in the JSON");
ABSL_FLAG(std::string, command, "", "recorded in the JSON");

namespace {

using lorastep::GroupKind;
using lorastep::TensorRole;

// The group each bucket is reduced over (GradFinalizer's plan).
GroupKind GroupOf(int bucket) {
  switch (bucket) {
    case TensorRole::kReplicatedPartial: return GroupKind::kStage;
    case TensorRole::kExpertReplicatedPartial: return GroupKind::kExpertStage;
    case TensorRole::kExpertSplit: return GroupKind::kExpertData;
    default: return GroupKind::kData;
  }
}

}  // namespace

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv, "digest_cost --model_dir DIR [--lora_rank 32 --tp 2 --out FILE]");
  std::ifstream in(absl::GetFlag(FLAGS_model_dir) + "/config.json");
  std::stringstream text;
  text << in.rdbuf();
  auto config = lorastep::ParseModelConfigJson(text.str());
  if (!config.ok()) {
    std::cerr << "model_dir: " << config.status() << "\n";
    return 1;
  }
  lorastep::ParallelSizes sizes;
  sizes.tp = absl::GetFlag(FLAGS_tp);
  sizes.pp = absl::GetFlag(FLAGS_pp);
  sizes.dp = absl::GetFlag(FLAGS_dp);
  auto layout = lorastep::ParallelLayout::Create(sizes, sizes.world());
  if (!layout.ok()) {
    std::cerr << layout.status() << "\n";
    return 1;
  }
  const lorastep::ModelShard shard = lorastep::MakeModelShard(sizes, layout->Coords(0), *config);
  lorastep::LoraConfig lora;
  lora.rank = absl::GetFlag(FLAGS_lora_rank);
  lora.alpha = static_cast<double>(lora.rank);
  const at::Device device(absl::GetFlag(FLAGS_device));
  auto adapter = lorastep::Adapter::CreateLora(*config, lora, device, at::kBFloat16, 1, &shard);
  if (!adapter.ok()) {
    std::cerr << adapter.status() << "\n";
    return 1;
  }
  std::vector<at::Tensor> checked;  // the buckets rank 0 compares: replicated over a group > 1
  nlohmann::json buckets = nlohmann::json::array();
  int64_t bytes = 0;
  for (int b = 0; b < lorastep::kNumGradBuckets; ++b) {
    const at::Tensor& grads = adapter->grad_bucket(static_cast<lorastep::GradBucket>(b));
    if (!grads.defined() || layout->Group(GroupOf(b), 0).size() <= 1) continue;
    grads.normal_();  // stands for the reduced sums
    checked.push_back(grads);
    bytes += grads.numel() * grads.element_size();
    buckets.push_back({{"bucket", b}, {"elements", grads.numel()}, {"dtype", std::string(c10::toString(grads.scalar_type()))}});
  }
  auto check = [&] {
    for (const at::Tensor& g : checked) lorastep::TensorsSha256({g});  // one digest per bucket, as the finalizer
  };
  for (int i = 0; i < 2; ++i) check();
  std::vector<double> ms;
  for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    check();  // returns host strings: synchronous
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  nlohmann::json out = {{"date", lorastep::UtcNowIso()},
                        {"machine", absl::GetFlag(FLAGS_machine)},
                        {"command", absl::GetFlag(FLAGS_command)},
                        {"libtorch", TORCH_VERSION},
                        {"layout", layout->ToString()},
                        {"lora_rank", lora.rank},
                        {"buckets", buckets},
                        {"bytes_hashed", bytes},
                        {"check_median_ms", median},
                        {"check_min_ms", ms.front()},
                        {"check_max_ms", ms.back()}};
  std::cout << out.dump() << "\n";
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << out.dump(2) << "\n";
  return 0;
}
