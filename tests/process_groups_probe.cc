// One rank of a real multi-process c10d test (driven by process_groups_test.cc):
//   process_groups_probe SCENARIO RANK WORLD TP PP DP STORE_PORT TIMEOUT_MS [DEVICE]
// DEVICE "cpu" (gloo, the default) or "cuda" (NCCL; rank r on cuda:r).
// Prints "OK" and exits 0 when the scenario's checks hold on this rank; otherwise prints
// what failed and exits 1. Scenarios "dead_peer" / "absent_peer": the last rank exits / stays
// alive without ever reaching the collective; the others print "ERROR <code> <elapsed_ms>
// <code of a later collective> | message" for the error they got.
#include <ATen/ATen.h>

#include <csignal>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "lib/parallel/process_groups.h"

namespace {

using namespace lorastep;

int Fail(const std::string& what) {
  std::cout << "FAIL " << what << std::endl;
  return 1;
}

at::TensorOptions g_options;  // the device collectives run on

// Each group kind: the SUM of (global rank + 1) over its members, and allgather order.
int RunCollectives(ProcessGroups& groups) {
  const int rank = groups.rank();
  const at::TensorOptions& o = g_options;
  for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline,
                         GroupKind::kStage, GroupKind::kModelParallel, GroupKind::kWorld}) {
    CommGroup& g = groups.group(kind);
    double want = 0;
    for (int r : g.ranks()) want += r + 1;
    at::Tensor t = at::full({3}, rank + 1.0, o.dtype(at::kDouble));
    if (auto s = g.AllReduce(t); !s.ok()) return Fail(s.ToString());
    if (t[2].item<double>() != want) return Fail(absl::StrCat(g.name(), " sum ", t[2].item<double>()));
    at::Tensor mx = at::full({1}, rank + 0.0, o.dtype(at::kFloat));
    if (auto s = g.AllReduce(mx, ReduceKind::kMax); !s.ok()) return Fail(s.ToString());
    if (mx.item<float>() != g.ranks().back()) return Fail(absl::StrCat(g.name(), " max"));
    std::vector<at::Tensor> several{at::ones({2, 2}, o), at::full({3}, rank + 0.0, o)};
    if (auto s = g.AllReduceCoalesced(several); !s.ok()) return Fail(s.ToString());
    if (several[0][1][1].item<float>() != g.size()) return Fail(absl::StrCat(g.name(), " coalesced"));
    auto gathered = g.AllGather(at::full({2}, rank + 0.0, o.dtype(at::kFloat)));
    if (!gathered.ok()) return Fail(gathered.status().ToString());
    for (int i = 0; i < g.size(); ++i) {
      if ((*gathered)[i][0].item<float>() != g.ranks()[i]) return Fail(absl::StrCat(g.name(), " gather"));
    }
    at::Tensor b = at::full({2}, rank + 0.0, o.dtype(at::kFloat));
    if (auto s = g.Broadcast(b, 0); !s.ok()) return Fail(s.ToString());
    if (b[0].item<float>() != g.ranks()[0]) return Fail(absl::StrCat(g.name(), " broadcast"));
    // bf16 (bf16 models' activations and gradients; gloo moves them as fp32).
    at::Tensor h = at::full({3}, rank + 1.0, o.dtype(at::kBFloat16));
    if (auto s = g.AllReduce(h); !s.ok()) return Fail(s.ToString());
    if (h.scalar_type() != at::kBFloat16 || h[2].item<float>() != want) return Fail(absl::StrCat(g.name(), " bf16 sum"));
    auto hg = g.AllGather(at::full({2}, rank + 0.0, o.dtype(at::kBFloat16)));
    if (!hg.ok()) return Fail(hg.status().ToString());
    for (int i = 0; i < g.size(); ++i) {
      if ((*hg)[i].scalar_type() != at::kBFloat16 || (*hg)[i][1].item<float>() != g.ranks()[i]) {
        return Fail(absl::StrCat(g.name(), " bf16 gather"));
      }
    }
    at::Tensor hb = at::full({2}, rank + 0.0, o.dtype(at::kBFloat16));
    if (auto s = g.Broadcast(hb, 0); !s.ok()) return Fail(s.ToString());
    if (hb[1].item<float>() != g.ranks()[0]) return Fail(absl::StrCat(g.name(), " bf16 broadcast"));
  }
  // All-to-all (expert dispatch) in fp32 and bf16: member i gets row (10 * rank + i) from each.
  CommGroup& world = groups.group(GroupKind::kWorld);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor rows = (at::arange(world.size(), o.dtype(at::kFloat)) + 10.0 * rank).to(dtype).reshape({-1, 1});
    std::vector<int64_t> splits(world.size(), 1);
    auto got = world.AllToAll(rows, splits, splits);
    if (!got.ok()) return Fail(got.status().ToString());
    for (int j = 0; j < world.size(); ++j) {
      if (got->scalar_type() != dtype || (*got)[j][0].item<float>() != 10.0f * world.ranks()[j] + world.rank()) {
        return Fail(absl::StrCat("alltoall ", c10::toString(dtype), " row ", j));
      }
    }
  }
  // Pipeline point to point: each stage sends to the next.
  CommGroup& pipe = groups.group(GroupKind::kPipeline);
  if (pipe.size() > 1) {
    if (pipe.rank() + 1 < pipe.size()) {
      if (auto s = pipe.Send(at::full({4}, rank + 0.5, o.dtype(at::kFloat)), pipe.rank() + 1); !s.ok()) {
        return Fail(s.ToString());
      }
    }
    if (pipe.rank() > 0) {
      at::Tensor in = at::zeros({4}, o.dtype(at::kFloat));
      if (auto s = pipe.Recv(in, pipe.rank() - 1); !s.ok()) return Fail(s.ToString());
      if (in[3].item<float>() != pipe.ranks()[pipe.rank() - 1] + 0.5f) return Fail("recv value");
    }
    // bf16 activations between stages: the paired send+recv of a middle stage too.
    at::Tensor out = at::full({4}, rank + 0.5, o.dtype(at::kBFloat16));
    at::Tensor in = at::zeros({4}, o.dtype(at::kBFloat16));
    const bool has_next = pipe.rank() + 1 < pipe.size(), has_prev = pipe.rank() > 0;
    if (auto s = pipe.SendRecv(has_next ? &out : nullptr, pipe.rank() + 1, 7, has_prev ? &in : nullptr,
                               pipe.rank() - 1, 7);
        !s.ok()) {
      return Fail(s.ToString());
    }
    if (has_prev && in[0].item<float>() != pipe.ranks()[pipe.rank() - 1] + 0.5f) return Fail("bf16 recv value");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9 && argc != 10) return Fail("usage");
  const std::string scenario = argv[1];
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  ParallelSizes sizes{std::stoi(argv[4]), std::stoi(argv[5]), std::stoi(argv[6])};
  auto layout = ParallelLayout::Create(sizes, world);
  if (!layout.ok()) return Fail(layout.status().ToString());
  ProcessGroupsOptions o;
  o.store_address = absl::StrCat("127.0.0.1:", argv[7]);
  o.rank = rank;
  o.layout = *layout;
  o.timeout = std::chrono::milliseconds(std::stoi(argv[8]));
  const std::string device = argc == 10 && std::string(argv[9]) == "cuda" ? absl::StrCat("cuda:", rank) : "cpu";
  o.device = device;
  g_options = at::TensorOptions().device(at::Device(device));
  o.defer_communicators = scenario == "replaced_rank0";
  auto groups = ProcessGroups::Create(o);
  if (!groups.ok()) return Fail(groups.status().ToString());
  auto world_sum = [&](ProcessGroups& g, float want) -> int {
    at::Tensor t = at::ones({4}, g_options);
    if (auto s = g.group(GroupKind::kWorld).AllReduce(t); !s.ok()) return Fail(s.ToString());
    if (t[0].item<float>() != want) return Fail("allreduce value");
    return 0;
  };
  if (scenario == "replaced_rank0") {
    // Deferred: nothing is formed until Rebuild, and a collective says so (no crash).
    at::Tensor t = at::ones({4}, g_options);
    absl::Status early = (*groups)->group(GroupKind::kWorld).AllReduce(t);
    if (early.code() != absl::StatusCode::kFailedPrecondition) return Fail("before forming: " + early.ToString());
    if (auto s = (*groups)->Rebuild(7); !s.ok()) return Fail(s.ToString());
    if (int rc = world_sum(**groups, world); rc != 0) return rc;
    if (rank == 0) {
      // Rank 0 "dies" and a new process takes its place: its store goes, a fresh one
      // serves at the same address.
      groups->reset();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the dead rank's gap: its peers see no store
      groups = ProcessGroups::Create(o);
      if (!groups.ok()) return Fail("replacement: " + groups.status().ToString());
    } else {
      // Until the new store serves: it is another process's, and this rank's only view of it
      // is the rebuild under test, which must not be what finds it.
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
    // The others reconnect to the new store when they form the next generation.
    if (auto s = (*groups)->Rebuild(8); !s.ok()) return Fail("after the replacement: " + s.ToString());
    if (int rc = world_sum(**groups, world); rc != 0) return rc;
  } else if (scenario == "collectives") {
    if (int rc = RunCollectives(**groups); rc != 0) return rc;
    // After a rebuild (new generation) the groups work again.
    if (auto s = (*groups)->Rebuild(1); !s.ok()) return Fail(s.ToString());
    if (int rc = RunCollectives(**groups); rc != 0) return rc;
  } else if (scenario == "dead_peer" || scenario == "absent_peer") {
    // One collective everyone completes first: the leaving rank must not close its sockets
    // while the others are still connecting (that fails ProcessGroups::Create instead of
    // the collective under test, seen on a loaded 2-core machine).
    at::Tensor warm = at::ones({1}, g_options);
    if (auto s = (*groups)->group(GroupKind::kWorld).AllReduce(warm); !s.ok()) return Fail(s.ToString());
    if (rank == world - 1) {
      std::cout << "LEFT" << std::endl;
      // dead: exits (its sockets close); absent: stays alive but never reaches the collective.
      // Absent: alive and silent past the others' timeouts (what the scenario is).
      if (scenario == "absent_peer") std::this_thread::sleep_for(3 * o.timeout + std::chrono::seconds(2));
      return 0;
    }
    // What gloo's write to the departed peer's socket raises: it must not end this rank.
    raise(SIGPIPE);
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor t = at::ones({8}, g_options);
    absl::Status s = (*groups)->group(GroupKind::kWorld).AllReduce(t);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - t0).count();
    if (s.ok()) return Fail("allreduce without a peer succeeded");
    // Later collectives fail fast until a rebuild.
    absl::Status again = (*groups)->group(GroupKind::kWorld).AllReduce(t);
    std::cout << "ERROR " << absl::StatusCodeToString(s.code()) << " " << ms << " "
              << absl::StatusCodeToString(again.code()) << " | " << s.message() << std::endl;
    return 0;
  } else {
    return Fail("unknown scenario");
  }
  std::cout << "OK" << std::endl;
  return 0;
}
