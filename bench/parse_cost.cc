// What the service's two hops cost the CPU in protobuf work alone, for the benchmark's
// batch (64 x 512 random tokens over the 0.5B vocabulary, one float field): parsing,
// serializing and copying a TrainStepRequest, mean of 50 each; then the same batch as
// packed_datums (targets of their own, and next-token targets as an RL rollout's), and each
// form's conversion to the trainer's datums.
//   bazel run //bench:parse_cost
#include <chrono>
#include <cstdio>
#include "bench/bench_batch.h"
#include "rpc/proto_convert.h"
#include "rpc/server_runner.h"

int main() {
  using namespace lorastep;
  TuneProcessForServing();  // as the servers: large buffers stay in the heap
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
  // The same batch as packed_datums (what the C++ client and the coordinator send), and a
  // batch of next-token targets (an RL rollout's: one last target per datum on the wire).
  for (const bool next : {false, true}) {
    const char* form = next ? "packed, next-token targets" : "packed";
    v1::TrainStepRequest packed;
    packed.set_run_id("run-1");
    const std::vector<v1::Datum> datums = next ? RandomBatch(64, 512, 151936, 1, true)
                                               : std::vector<v1::Datum>(req.datums().begin(), req.datums().end());
    if (!PackDatums(datums, packed.mutable_packed_datums())) return 1;
    const std::string packed_bytes = packed.SerializeAsString();
    std::printf("%s: bytes %zu\n", form, packed_bytes.size());
    v1::PackedDatums reused;  // as the C++ client packs: into the same message every step
    std::printf("%s: pack %.3f ms\n", form, time([&] { PackDatums(datums, &reused); }));
    std::printf("%s: parse %.3f ms\n", form, time([&] { v1::TrainStepRequest r; r.ParseFromString(packed_bytes); }));
    std::printf("%s: serialize %.3f ms\n", form, time([&] { std::string s = packed.SerializeAsString(); }));
    std::printf("%s: to trainer datums %.3f ms\n", form,
                time([&] { auto d = RequestDatums(packed.datums(), packed.packed_datums()); }));
  }
  std::printf("datums: to trainer datums %.3f ms\n", time([&] { auto d = RequestDatums(req.datums(), req.packed_datums()); }));
  return 0;
}
