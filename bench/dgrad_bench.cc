// Frozen-weight dgrad microbenchmark at the seed's shape (Qwen2.5-0.5B output layer):
// grad_output [s, b, V] x W [V, H], three ways, side by side in one process:
//   contiguous_ms         at::matmul on a tensor laid out [s, b, V]
//   flattened_strided_ms  lorastep::LinearInputGrad on the [b, s, V] -> [s, b, V] view
//   naive_strided_ms      at::matmul on that same view (what the seed's bug ran)
// Each figure is the median over `reps` timings of `inner` back-to-back calls, with the
// device synchronized around each timing. Writes JSON to --out.
//   dgrad_bench --device cuda --out dgrad.json --machine "NVIDIA H200" --command "..."
#include <ATen/ATen.h>
#include <torch/version.h>

#include "absl/flags/flag.h"
#include "lib/flags_util.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_stats.h"
#include "bench/device_timing.h"
#include "lib/model/linear.h"
#include "nlohmann/json.hpp"


// (Not --v for the vocabulary: glog, which Debian's LibTorch uses, owns FLAGS_v.)
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(std::string, out, "dgrad.json", "write the JSON result here");
ABSL_FLAG(std::string, machine, "unknown", "recorded in the JSON");
ABSL_FLAG(std::string, command, "", "the command, recorded in the JSON");
ABSL_FLAG(int64_t, seq, 512, "sequence length (s)");
ABSL_FLAG(int64_t, batch, 1, "batch (b)");
ABSL_FLAG(int64_t, vocab, 151936, "output features of the linear (the LM head's vocabulary)");
ABSL_FLAG(int64_t, hidden, 896, "input features of the linear");
ABSL_FLAG(std::string, dtype, "bfloat16", "bfloat16 or float32");

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv, "dgrad_bench --device cuda --out dgrad.json [--machine M --command C]");
  const std::string device_name = absl::GetFlag(FLAGS_device), out = absl::GetFlag(FLAGS_out),
                    machine = absl::GetFlag(FLAGS_machine), command = absl::GetFlag(FLAGS_command),
                    dtype = absl::GetFlag(FLAGS_dtype);
  const int64_t s = absl::GetFlag(FLAGS_seq), b = absl::GetFlag(FLAGS_batch), v = absl::GetFlag(FLAGS_vocab),
                h = absl::GetFlag(FLAGS_hidden);
  const at::Device device(device_name);
  const at::ScalarType type = dtype == "float32" ? at::kFloat : at::kBFloat16;
  const auto options = at::TensorOptions().device(device).dtype(type);
  at::Tensor w = at::randn({v, h}, options);
  at::Tensor contiguous = at::randn({s, b, v}, options);
  at::Tensor strided = at::randn({b, s, v}, options).transpose(0, 1);
  const bool cuda = device.is_cuda();
  const int reps = cuda ? 21 : 5;
  const double contiguous_ms = lorastep::DeviceMedianMs(device, reps, cuda ? 50 : 2, [&] { at::matmul(contiguous, w); });
  const double flattened_ms =
      lorastep::DeviceMedianMs(device, reps, cuda ? 50 : 2, [&] { lorastep::LinearInputGrad(strided, w, false); });
  const double naive_ms = lorastep::DeviceMedianMs(device, reps, cuda ? 3 : 1, [&] { at::matmul(strided, w); });
  // The three must agree (same data through different kernels).
  at::Tensor ref = at::matmul(strided.contiguous(), w).to(at::kFloat);
  const double err_flat = ((lorastep::LinearInputGrad(strided, w, false).to(at::kFloat) - ref).norm() / ref.norm()).item<double>();

  nlohmann::ordered_json j;
  j["date"] = lorastep::UtcNowIso();
  j["machine"] = machine;
  j["device"] = device_name;
  j["torch_version"] = TORCH_VERSION;
  j["command"] = command;
  j["shape"] = {{"s", s}, {"b", b}, {"V", v}, {"H", h}, {"dtype", dtype}};
  j["contiguous_ms"] = contiguous_ms;
  j["flattened_strided_ms"] = flattened_ms;
  j["naive_strided_ms"] = naive_ms;
  j["flattened_over_contiguous"] = flattened_ms / contiguous_ms;
  j["naive_over_flattened"] = naive_ms / flattened_ms;
  j["flattened_rel_err"] = err_flat;
  j["method"] = "median of reps timings of inner back-to-back calls, device synced around each";
  std::ofstream(out) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return 0;
}
