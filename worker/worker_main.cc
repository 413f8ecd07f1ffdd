// lorastep_worker: one per GPU (or one CPU process). Loads the base model once and serves
// the internal Worker API.
//   lorastep_worker --model DIR [--device cuda:0] [--dtype bfloat16] [--host 127.0.0.1]
//                   [--port 0] [--port_file F] [--max_tokens_per_microbatch N] [--unfused_wgrad]
//                   [--register_with COORDINATOR_HOST:PORT] [--advertise_host H]
//                   [--rank R --tp T --pp P --dp D --rendezvous HOST:PORT]
//                   [--collective_timeout_s S] [--state_dir DIR (path fields are then
//                   lorastep://<run>/<name> references under DIR)] [--state_ttl_hours H]
//                   [--max_activation_mb M]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/grpc_status.h"

#include "lib/io/state_store.h"
#include "rpc/bearer_token.h"
#include "rpc/metrics_http_server.h"
#include "rpc/server_runner.h"
#include "worker/worker_core.h"
#include "worker/worker_service.h"

namespace {

// Announces this worker to a coordinator, retrying while the coordinator starts.
absl::Status RegisterWithCoordinator(const std::string& coordinator, const std::string& self,
                                     int timeout_seconds, const std::string& authorization) {
  auto channel = grpc::CreateChannel(coordinator, grpc::InsecureChannelCredentials());
  auto stub = lorastep::v1::Registry::NewStub(channel);
  lorastep::v1::RegisterWorkerRequest req;
  req.set_address(self);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  absl::Status last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = lorastep::CallUnary<lorastep::v1::RegisterWorkerResponse>(
        stub.get(), &lorastep::v1::Registry::Stub::RegisterWorker, req, std::chrono::seconds(0), authorization);
    if (r.ok()) return absl::OkStatus();
    last = r.status();
    if (!absl::IsUnavailable(last)) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("registering with ", coordinator, ": ", last.message()));
}

// Asks the coordinator for a rank of its mesh. NOT_FOUND-like answers (no mesh there) come
// back as FAILED_PRECONDITION: the worker then registers on its own, at world size 1.
absl::StatusOr<lorastep::v1::JoinMeshResponse> JoinMesh(const std::string& coordinator,
                                                        const std::string& host, int timeout_seconds,
                                                        const std::string& authorization) {
  auto channel = grpc::CreateChannel(coordinator, grpc::InsecureChannelCredentials());
  auto stub = lorastep::v1::Registry::NewStub(channel);
  lorastep::v1::JoinMeshRequest req;
  req.set_host(host);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  absl::Status last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = lorastep::CallUnary<lorastep::v1::JoinMeshResponse>(
        stub.get(), &lorastep::v1::Registry::Stub::JoinMesh, req, std::chrono::seconds(0), authorization);
    if (r.ok() || !absl::IsUnavailable(r.status())) return r;
    last = r.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("joining the mesh of ", coordinator, ": ", last.message()));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  BlockShutdownSignals();
  auto flags = ParseFlags(argc, argv);
  if (absl::Status known = CheckKnownFlags(
          flags, {"model", "device", "dtype", "port", "host", "port_file", "max_tokens_per_microbatch",
                  "collective_timeout_s", "state_dir", "state_ttl_hours", "max_activation_mb", "unfused_wgrad",
                  "rank", "tp", "pp", "dp", "ep", "rendezvous", "register_with", "advertise_host",
                  "worker_token_file", "v"});
      !known.ok()) {
    std::cerr << "lorastep_worker: " << known << "\n";
    return 2;
  }
  // Prometheus: off unless --metrics_port (loopback only without --metrics_allow_remote).
  PrometheusRegistry metrics;
  auto metrics_endpoint = StartMetricsEndpointFromFlags(flags, &metrics);
  if (!metrics_endpoint.ok()) {
    std::cerr << "lorastep_worker: " << metrics_endpoint.status() << "\n";
    return 2;
  }
  // --worker_token_file: every call to this worker must present the token, and the worker
  // presents it when registering.
  std::string token_sha256, authorization;
  if (flags.count("worker_token_file")) {
    auto token = LoadTokenFile(flags["worker_token_file"]);
    if (!token.ok()) {
      std::cerr << "lorastep_worker: " << token.status() << "\n";
      return 2;
    }
    token_sha256 = Sha256Hex(*token);
    authorization = "Bearer " + *token;
  }
  WorkerOptions options;
  options.model_path = flags["model"];
  if (options.model_path.empty()) {
    std::cerr << "lorastep_worker: --model is required\n";
    return 2;
  }
  if (flags.count("device")) options.device = flags["device"];
  if (flags.count("dtype")) options.dtype = flags["dtype"];
  if (flags.count("max_tokens_per_microbatch")) {
    options.max_tokens_per_microbatch = std::stoll(flags["max_tokens_per_microbatch"]);
  }
  options.grad.fused_wgrad = !flags.count("unfused_wgrad");
  if (flags.count("state_dir")) options.state_dir = flags["state_dir"];
  // MiB one micro-batch's activations may take (estimated before running; over it the call is
  // RESOURCE_EXHAUSTED). 0 (default): 80% of the available host memory on CPU; -1: off.
  if (flags.count("max_activation_mb")) {
    const double mb = std::stod(flags["max_activation_mb"]);
    options.max_activation_bytes = mb < 0 ? -1 : static_cast<int64_t>(mb * 1024 * 1024);
  }
  // Environment, so a worker the coordinator starts inherits it (bench/step_bench.sh).
  if (const char* trace = std::getenv("LORASTEP_PROFILE_TRACE")) {
    options.profile_trace_path = trace;
    const char* step = std::getenv("LORASTEP_PROFILE_STEP");
    options.profile_train_step = step != nullptr ? std::atoll(step) : 2;
  }
  // Mesh: --rank R --tp T --pp P --dp D --rendezvous HOST:PORT [--collective_timeout_s S].
  if (flags.count("rank")) options.rank = std::stoi(flags["rank"]);
  if (flags.count("tp")) options.sizes.tp = std::stoi(flags["tp"]);
  if (flags.count("pp")) options.sizes.pp = std::stoi(flags["pp"]);
  if (flags.count("dp")) options.sizes.dp = std::stoi(flags["dp"]);
  if (flags.count("ep")) options.sizes.ep = std::stoi(flags["ep"]);
  if (flags.count("rendezvous")) options.rendezvous = flags["rendezvous"];
  if (flags.count("collective_timeout_s")) {
    options.collective_timeout = std::chrono::seconds(std::stoi(flags["collective_timeout_s"]));
  }
  // Test only: reductions of tensor-replicated gradients per step (1 correct; 0 and 2 are
  // the bugs the replica check must catch).
  if (flags.count("test_replicated_reductions")) {
    options.finalize.replicated_reductions = std::stoi(flags["test_replicated_reductions"]);
  }
  // Test only, shared-outer expert factors (the second seed): skip one family's reduction,
  // reduce twice, run without the digest checks, corrupt one rank's main_grad, or alter one
  // rank's factor inventory.
  if (flags.count("test_skip_shared_reduction")) {
    options.finalize.skip_shared_family = flags["test_skip_shared_reduction"];
  }
  if (flags.count("test_shared_reductions")) {
    options.finalize.shared_reductions = std::stoi(flags["test_shared_reductions"]);
  }
  if (flags.count("test_check_grad_digests")) {
    options.finalize.check_digests = flags["test_check_grad_digests"] != "0";
  }
  if (flags.count("test_corrupt_main_grad_rank")) {
    options.finalize.corrupt_main_grad_rank = std::stoi(flags["test_corrupt_main_grad_rank"]);
  }
  if (flags.count("test_inventory_mismatch_rank")) {
    options.finalize.inventory_mismatch_rank = std::stoi(flags["test_inventory_mismatch_rank"]);
  }
  const std::string advertise_host =
      flags.count("advertise_host") ? flags["advertise_host"] : (flags.count("host") ? flags["host"] : "127.0.0.1");
  options.gloo_host = advertise_host;
  if (flags.count("register_with") && !flags.count("rank")) {
    // A coordinator running a mesh hands out the rank (and sizes, rendezvous) first.
    auto joined = JoinMesh(flags["register_with"], advertise_host, 60, authorization);
    if (joined.ok()) {
      options.rank = joined->rank();
      options.sizes = {joined->tp(), joined->pp(), joined->dp(), std::max(1, joined->ep())};
      options.rendezvous = joined->rendezvous();
      std::cerr << "lorastep_worker: rank " << options.rank << " of " << options.sizes.world()
                << ", rendezvous " << options.rendezvous << "\n";
    } else if (!absl::IsFailedPrecondition(joined.status()) ||
               joined.status().message().find("runs no mesh") == absl::string_view::npos) {
      std::cerr << "lorastep_worker: " << joined.status() << "\n";
      return 1;
    }
  }
  auto core = WorkerCore::Create(options);
  if (!core.ok()) {
    std::cerr << "lorastep_worker: " << core.status() << "\n";
    return 1;
  }
  // --state_ttl_hours: lorastep's folders in the state store older than this are removed,
  // checked every tenth of the TTL (1 s to 10 min); one pruner per store (rank 0).
  double ttl_hours = 0;
  if (flags.count("state_ttl_hours") &&
      (!absl::SimpleAtod(flags["state_ttl_hours"], &ttl_hours) || !(ttl_hours > 0) || options.state_dir.empty())) {
    std::cerr << "lorastep_worker: state_ttl_hours: '" << flags["state_ttl_hours"]
              << "' must be a positive number of hours, with --state_dir\n";
    return 2;
  }
  WorkerService service(core->get(), &metrics, token_sha256);
  int port = 0;
  auto server = StartGrpcServer(flags.count("host") ? flags["host"] : "127.0.0.1",
                                flags.count("port") ? std::stoi(flags["port"]) : 0, {&service},
                                &port, 1 << 30,
                                CallObservers{&metrics, flags.count("v") ? std::stoi(flags["v"]) : 1, "worker",
                                              options.sizes.world() > 1 ? options.rank : -1});
  if (!server.ok()) {
    std::cerr << "lorastep_worker: " << server.status() << "\n";
    return 1;
  }
  if (flags.count("port_file")) {
    if (auto s = WritePortFile(flags["port_file"], port); !s.ok()) {
      std::cerr << "lorastep_worker: " << s << "\n";
      return 1;
    }
  }
  std::cerr << "lorastep_worker: serving " << options.model_path << " on port " << port << " ("
            << (*core)->base().device.str() << ")\n";
  if (flags.count("register_with")) {
    const std::string self = absl::StrCat(advertise_host, ":", port);
    if (auto s = RegisterWithCoordinator(flags["register_with"], self, 60, authorization); !s.ok()) {
      std::cerr << "lorastep_worker: " << s << "\n";
      (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
      return 1;
    }
  }
  std::mutex prune_mu;
  std::condition_variable prune_cv;
  bool stopping = false;
  std::thread pruner;
  if (ttl_hours > 0 && options.rank == 0) {
    const int64_t ttl_s = std::max<int64_t>(1, static_cast<int64_t>(ttl_hours * 3600));
    pruner = std::thread([&, ttl_s] {
      auto store = StateStore::Open(options.state_dir);
      const auto every = std::chrono::seconds(std::clamp<int64_t>(ttl_s / 10, 1, 600));
      std::unique_lock<std::mutex> lock(prune_mu);
      do {
        auto removed = store.ok() ? store->PruneOlderThan(ttl_s, static_cast<int64_t>(std::time(nullptr)))
                                  : absl::StatusOr<std::vector<std::string>>(store.status());
        if (!removed.ok()) {
          std::cerr << "lorastep_worker: state store TTL: " << removed.status() << "\n";
        } else if (!removed->empty()) {
          std::cerr << "lorastep_worker: state store TTL removed " << removed->size() << " folder(s): "
                    << absl::StrJoin(*removed, ", ") << "\n";
        }
      } while (!prune_cv.wait_for(lock, every, [&] { return stopping; }));
    });
  }
  WaitForShutdownSignal();
  {
    std::lock_guard<std::mutex> lock(prune_mu);
    stopping = true;
  }
  prune_cv.notify_all();
  if (pruner.joinable()) pruner.join();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  return 0;
}
