// The cost of one Gated DeltaNet layer's token mixer in a training step, at a Qwen3.5 shape
// (default: the qwen3.5-9b preset's layer), forward and backward through autograd, on packed
// sequences as a LoRA step sees them (`--seqs` x `--len` tokens in one row):
//   mixer_ms       GatedDeltaNetMix with its five projections as plain matmuls (frozen
//                  weights: the input gradient only)
//   projections_ms the same five matmuls alone, forward and backward
//   rule_ms        the gated delta rule alone (PackedGatedDeltaRule), forward and backward
// mixer_ms - projections_ms is what a fused kernel could take (convolution, gates, rule,
// gated norm); times the model's linear-layer count, it is that part's cost per step, to set
// beside the step time of the same batch (bench/step_family.sh). Medians over `--reps`.
//   gated_delta_bench --device cuda --out gdn.json [--seqs 8 --len 512] [--machine M --command C]
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_stats.h"
#include "bench/device_timing.h"
#include "lib/device_stats.h"
#include "lib/flags_util.h"
#include "lib/model/gated_delta.h"
#include "lib/model/lora_config.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, device, "cuda", "cpu or cuda");
ABSL_FLAG(std::string, out, "gated_delta.json", "write the JSON result here");
ABSL_FLAG(std::string, machine, "unknown", "recorded in the JSON");
ABSL_FLAG(std::string, command, "", "the command, recorded in the JSON");
ABSL_FLAG(int64_t, seqs, 8, "sequences packed in the row (one micro-batch)");
ABSL_FLAG(int64_t, len, 512, "tokens per sequence");
ABSL_FLAG(int64_t, hidden, 4096, "hidden size");
ABSL_FLAG(int64_t, key_heads, 16, "linear_num_key_heads");
ABSL_FLAG(int64_t, value_heads, 32, "linear_num_value_heads");
ABSL_FLAG(int64_t, head_dim, 128, "linear key and value head dim");
ABSL_FLAG(int64_t, reps, 11, "timed repetitions (the median is reported)");
ABSL_FLAG(std::string, dtype, "bfloat16", "bfloat16 or float32");
ABSL_FLAG(std::string, trace, "", "if set: a Kineto trace of one more mixer pass, forward and backward, saved here");
ABSL_FLAG(bool, keep_rule, false,
          "the mixer's rule keeps its intermediates for backward (ForwardOptions::keep_linear_attention_rule) "
          "instead of running again there");
ABSL_FLAG(std::string, matmul_precision, "highest",
          "fp32 matmul precision (highest: fp32; high: TF32 tensor cores on CUDA), for an A/B of the rule");

namespace {

void Backward(const at::Tensor& out, const at::Tensor& input) {
  torch::autograd::grad({out}, {input}, {at::ones_like(out)});
}

}  // namespace

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv, "gated_delta_bench --device cuda --out gdn.json");
  const at::Device device(absl::GetFlag(FLAGS_device));
  at::globalContext().setFloat32MatmulPrecision(absl::GetFlag(FLAGS_matmul_precision));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  const auto options = at::TensorOptions().device(device).dtype(dtype == "float32" ? at::kFloat : at::kBFloat16);
  const int64_t seqs = absl::GetFlag(FLAGS_seqs), len = absl::GetFlag(FLAGS_len), h = absl::GetFlag(FLAGS_hidden);
  const int reps = static_cast<int>(absl::GetFlag(FLAGS_reps));
  lorastep::LinearAttentionConfig config;
  config.num_key_heads = absl::GetFlag(FLAGS_key_heads);
  config.num_value_heads = absl::GetFlag(FLAGS_value_heads);
  config.key_head_dim = config.value_head_dim = absl::GetFlag(FLAGS_head_dim);
  const int64_t hv = config.num_value_heads, tokens = seqs * len;
  const std::vector<int64_t> lengths(seqs, len);

  // The projections in slot order from kInProjQkv: qkv, z, b, a, out.
  const std::vector<int64_t> outs = {config.conv_dim(), config.value_dim(), hv, hv, h};
  std::vector<at::Tensor> weights;
  for (size_t i = 0; i < outs.size(); ++i) {
    const int64_t in = i + 1 == outs.size() ? config.value_dim() : h;
    weights.push_back(at::randn({outs[i], in}, options) / std::sqrt(static_cast<double>(in)));
  }
  lorastep::GatedDeltaWeights own;
  own.conv1d = at::randn({config.conv_dim(), 1, config.conv_kernel}, options) * 0.3;
  own.a_log = at::log(at::rand({hv}, options.dtype(at::kFloat)) * 15 + 1);
  own.dt_bias = at::ones({hv}, options.dtype(at::kFloat));
  own.norm = at::ones({config.value_head_dim}, options);
  const auto project = [&](int slot, const at::Tensor& x) {
    return at::matmul(x, weights[slot - lorastep::kInProjQkv].t());
  };
  const at::Tensor input = at::randn({1, tokens, h}, options).requires_grad_(true);
  const bool keep_rule = absl::GetFlag(FLAGS_keep_rule);

  const double mixer_ms = lorastep::DeviceMedianMs(device, reps, 1, [&] {
    Backward(lorastep::GatedDeltaNetMix(config, own, project, input, lengths, 1e-6, nullptr, 0, nullptr, keep_rule),
             input);
  });
  const at::Tensor mixed = at::randn({1, tokens, config.value_dim()}, options).requires_grad_(true);
  const double projections_ms = lorastep::DeviceMedianMs(device, reps, 1, [&] {
    for (size_t i = 0; i < outs.size(); ++i) {
      const at::Tensor& x = i + 1 == outs.size() ? mixed : input;
      Backward(project(lorastep::kInProjQkv + static_cast<int>(i), x), x);
    }
  });
  const auto rule_input = [&](std::vector<int64_t> shape) {
    return at::randn(shape, options).requires_grad_(true);
  };
  const at::Tensor q = rule_input({1, tokens, config.num_key_heads, config.key_head_dim});
  const at::Tensor k = rule_input({1, tokens, config.num_key_heads, config.key_head_dim});
  const at::Tensor v = rule_input({1, tokens, hv, config.value_head_dim});
  const at::Tensor g = (-at::rand({1, tokens, hv}, options.dtype(at::kFloat)) * 0.1).requires_grad_(true);
  const at::Tensor beta = at::rand({1, tokens, hv}, options).requires_grad_(true);
  const double rule_ms = lorastep::DeviceMedianMs(device, reps, 1, [&] {
    const at::Tensor out = lorastep::PackedGatedDeltaRule(q / q.norm(2, -1, true), k / k.norm(2, -1, true), v, g,
                                                          beta, lengths, lorastep::kGatedDeltaChunk);
    torch::autograd::grad({out}, {q, k, v, g, beta}, {at::ones_like(out)});
  });

  if (const std::string trace = absl::GetFlag(FLAGS_trace); !trace.empty()) {
    const absl::Status started = lorastep::StartKernelProfile();
    if (!started.ok()) {
      std::cerr << started << "\n";
      return 1;
    }
    Backward(lorastep::GatedDeltaNetMix(config, own, project, input, lengths, 1e-6, nullptr, 0, nullptr, keep_rule),
             input);
    if (const absl::Status stopped = lorastep::StopKernelProfile(trace); !stopped.ok()) {
      std::cerr << stopped << "\n";
      return 1;
    }
  }

  nlohmann::ordered_json j;
  j["date"] = lorastep::UtcNowIso();
  j["machine"] = absl::GetFlag(FLAGS_machine);
  j["torch_version"] = TORCH_VERSION;
  j["command"] = absl::GetFlag(FLAGS_command);
  j["shape"] = {{"seqs", seqs}, {"len", len}, {"hidden", h}, {"key_heads", config.num_key_heads},
                {"value_heads", hv}, {"head_dim", config.key_head_dim}, {"chunk", lorastep::kGatedDeltaChunk},
                {"dtype", dtype}};
  j["matmul_precision"] = absl::GetFlag(FLAGS_matmul_precision);
  j["keep_rule"] = keep_rule;
  j["mixer_ms"] = mixer_ms;
  j["projections_ms"] = projections_ms;
  j["rule_ms"] = rule_ms;
  j["mixer_without_projections_ms"] = mixer_ms - projections_ms;
  j["method"] = "forward + backward (input gradients through autograd), median of reps, device synced around each";
  std::ofstream(absl::GetFlag(FLAGS_out)) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return 0;
}
