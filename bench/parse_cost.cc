// What the service's two hops cost the CPU in protobuf work alone, for the benchmark's
// batch (64 x 512 random tokens over the 0.5B vocabulary, one float field): parsing,
// serializing and copying a TrainStepRequest, mean of 50 each.
//   bazel run //bench:parse_cost
#include <chrono>
#include <cstdio>
#include "bench/bench_batch.h"

int main() {
  using namespace lorastep;
  v1::TrainStepRequest req;
  req.set_run_id("run-1");
  for (auto& d : RandomBatch(64, 512, 151936)) *req.add_datums() = d;
  std::string bytes = req.SerializeAsString();
  auto time = [](auto f) { auto t0 = std::chrono::steady_clock::now(); for (int i = 0; i < 50; ++i) f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 50; };
  std::printf("bytes %zu\n", bytes.size());
  std::printf("parse %.3f ms\n", time([&] { v1::TrainStepRequest r; r.ParseFromString(bytes); }));
  std::printf("serialize %.3f ms\n", time([&] { std::string s = req.SerializeAsString(); }));
  std::printf("copy %.3f ms\n", time([&] { v1::TrainStepRequest r = req; }));
  return 0;
}
