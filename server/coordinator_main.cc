// lorastep_coordinator: the public Trainer API. By default it starts one local worker
// process on the given model; with --workers it uses running workers instead; with
// --wait_for_workers it starts with none and waits for workers to register
// (lorastep_worker --register_with this address).
//   lorastep_coordinator --model DIR [--device cpu] [--dtype D] [--port 50051] [--host 127.0.0.1]
//                        [--port_file F] [--workers host:port,host:port] [--wait_for_workers]
//                        [--worker_binary PATH] [--max_tokens_per_microbatch N]
//                        [--worker_start_timeout_s 300]
//                        [--tp T --pp P --dp D] [--collective_timeout_s S] [--peer_failure_grace_s G]
//                        [--worker_call_timeout_s 3600] [--rendezvous_port 29500]
//                        [--state_dir DIR: checkpoints and exports as lorastep://<run>/<name>
//                        references under DIR, passed to local workers]
//                        [--metrics_port P [--metrics_host 127.0.0.1] [--metrics_allow_remote]
//                        [--metrics_port_file F]: Prometheus text format at GET /metrics]
//                        [--worker_metrics_port_base B: local worker r serves its own on B + r]
//                        [--v 1: per-call log lines on stderr; 0 failures only, 2 with health checks]
//                        [--api_keys_file F: lines "KEY OWNER [admin]"; calls need "authorization:
//                        Bearer KEY" and see only their owner's runs] [--allow_unauthenticated_remote]
//                        [--worker_token_file F: shared secret for the Worker port and the Registry]
//                        [--tls_cert_file C --tls_key_file K: the Trainer API over TLS (PEM)]
//                        [--max_queued_per_run 64] [--max_queued 4096]: calls in flight beyond them
//                        are RESOURCE_EXHAUSTED with retry advice
// With --wait_for_workers and --tp/--pp/--dp, workers started with --register_with and no
// --rank get their ranks here in the order they ask (JoinMesh); rank 0 serves the
// rendezvous at its host and --rendezvous_port.
// With --tp/--pp/--dp (default 1) it starts tp*pp*dp local workers, rank r on cuda:r (or a
// CPU process each), forming one mesh; with --workers the listed workers must be the ranks
// of such a mesh (started with matching --rank/--tp/--pp/--dp/--rendezvous).
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "lib/parallel/parallel_layout.h"
#include "rpc/metrics_http_server.h"
#include "server/api_keys.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/grpc_worker_client.h"
#include "server/registry_service.h"
#include "server/child_server.h"
#include "rpc/server_runner.h"

int main(int argc, char** argv) {
  using namespace lorastep;
  BlockShutdownSignals();
  auto flags = ParseFlags(argc, argv);
  auto fail = [](const absl::Status& s) {
    std::cerr << "lorastep_coordinator: " << s << "\n";
    return 1;
  };
  if (absl::Status known = CheckKnownFlags(
          flags, {"model", "device", "dtype", "port", "host", "port_file", "workers", "wait_for_workers",
                  "worker_binary", "max_tokens_per_microbatch", "worker_start_timeout_s", "tp", "pp", "dp", "ep",
                  "collective_timeout_s", "peer_failure_grace_s", "worker_call_timeout_s", "rendezvous_port",
                  "state_dir", "state_ttl_hours", "worker_metrics_port_base", "v", "api_keys_file",
                  "allow_unauthenticated_remote", "worker_token_file", "tls_cert_file", "tls_key_file",
                  "max_queued_per_run", "max_queued", "max_runs", "max_request_mb", "max_recorded_mb",
                  "max_activation_mb", "unfused_wgrad"});
      !known.ok()) {
    std::cerr << "lorastep_coordinator: " << known << "\n";
    return 2;
  }
  // Prometheus: off unless --metrics_port; refused on a non-loopback host without
  // --metrics_allow_remote (checked before any worker starts).
  PrometheusRegistry metrics;
  auto metrics_endpoint = StartMetricsEndpointFromFlags(flags, &metrics);
  if (!metrics_endpoint.ok()) return fail(metrics_endpoint.status());
  // --api_keys_file: every Trainer call needs a key, and callers see only their own runs.
  // Without it the coordinator listens on loopback only, unless told otherwise.
  std::optional<ApiKeys> api_keys;
  if (flags.count("api_keys_file")) {
    auto loaded = ApiKeys::Load(flags["api_keys_file"]);
    if (!loaded.ok()) return fail(loaded.status());
    api_keys = std::move(loaded).value();
  }
  // --worker_token_file: the secret the coordinator and its workers present to each other
  // (Worker port, Registry); passed on to local workers.
  std::string worker_token;
  if (flags.count("worker_token_file")) {
    auto token = LoadTokenFile(flags["worker_token_file"]);
    if (!token.ok()) return fail(token.status());
    worker_token = *token;
  }
  const std::string host = flags.count("host") ? flags["host"] : "127.0.0.1";
  if (!api_keys && host != "127.0.0.1" && host != "localhost" && host != "::1" &&
      !flags.count("allow_unauthenticated_remote")) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "host: '", host, "' is reachable from other machines; start with --api_keys_file (or, on a trusted "
        "network only, --allow_unauthenticated_remote)")));
  }
  // --v: per-call log lines (0 = failures only, 1 = every call, 2 = with health checks).
  const int log_verbosity = flags.count("v") ? std::stoi(flags["v"]) : 1;
  CoordinatorOptions options;
  options.metrics = &metrics;
  for (auto [flag, field] : {std::pair<const char*, int*>{"tp", &options.mesh.tp},
                             {"pp", &options.mesh.pp}, {"dp", &options.mesh.dp},
                             {"ep", &options.mesh.ep}}) {
    if (flags.count(flag)) *field = std::stoi(flags[flag]);
  }
  if (auto layout = ParallelLayout::Create(options.mesh, options.mesh.world()); !layout.ok()) {
    return fail(layout.status());
  }
  if (flags.count("rendezvous_port")) options.rendezvous_port = std::stoi(flags["rendezvous_port"]);
  // Bounds: the largest request a client may send (MiB), and how many runs may exist.
  const int max_request_mb = flags.count("max_request_mb") ? std::stoi(flags["max_request_mb"]) : 64;
  if (max_request_mb < 1 || max_request_mb > 1024) {
    std::cerr << "lorastep_coordinator: --max_request_mb: must be in [1, 1024]\n";
    return 2;
  }
  const int max_request_bytes = max_request_mb << 20;
  if (flags.count("max_runs")) options.max_runs = std::stoul(flags["max_runs"]);
  if (flags.count("max_recorded_mb")) {  // may be fractional
    options.max_recorded_bytes = static_cast<size_t>(std::stod(flags["max_recorded_mb"]) * (1 << 20));
  }
  const int world = options.mesh.world();
  // A rank that fails on its own makes its peers fail at their collective timeout (the
  // worker's default is 120 s); past that plus 30 s their calls are cancelled.
  options.peer_failure_grace = std::chrono::seconds(
      flags.count("peer_failure_grace_s")
          ? std::stoi(flags["peer_failure_grace_s"])
          : (flags.count("collective_timeout_s") ? std::stoi(flags["collective_timeout_s"]) : 120) + 30);
  const int worker_call_timeout =
      flags.count("worker_call_timeout_s") ? std::stoi(flags["worker_call_timeout_s"]) : 3600;
  std::vector<std::string> addresses;
  std::vector<ChildServer> local;
  if (flags.count("workers")) {
    addresses = absl::StrSplit(flags["workers"], ',', absl::SkipEmpty());
  } else if (!flags.count("wait_for_workers")) {
    if (flags["model"].empty()) {
      std::cerr << "lorastep_coordinator: --model (for the local worker) or --workers is required\n";
      return 2;
    }
    std::vector<std::string> args = {"--model", flags["model"]};
    std::set<std::string> passed = WorkerTestFlagNames();
    passed.insert({"dtype", "max_tokens_per_microbatch", "collective_timeout_s", "state_dir", "v", "state_ttl_hours",
                   "worker_token_file", "max_activation_mb"});
    for (const std::string& pass : passed) {
      if (flags.count(pass)) args.insert(args.end(), {"--" + pass, flags[pass]});
    }
    if (flags.count("unfused_wgrad")) args.push_back("--unfused_wgrad");
    const std::string device = flags.count("device") ? flags["device"] : "cpu";
    // One worker per rank (one per GPU: rank r on cuda:r), meeting at a TCPStore that
    // rank 0 serves on a free local port.
    std::vector<std::vector<std::string>> per_rank;
    const std::string rendezvous = world > 1 ? absl::StrCat("127.0.0.1:", FreeLocalPort()) : "";
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> a = args;
      const bool cuda = device.rfind("cuda", 0) == 0;
      a.insert(a.end(), {"--device", cuda && world > 1 ? absl::StrCat("cuda:", r) : device});
      if (world > 1) {
        a.insert(a.end(), {"--rank", std::to_string(r), "--tp", std::to_string(options.mesh.tp),
                           "--pp", std::to_string(options.mesh.pp), "--dp",
                           std::to_string(options.mesh.dp), "--ep", std::to_string(options.mesh.ep),
                           "--rendezvous", rendezvous});
      }
      if (flags.count("worker_metrics_port_base")) {  // local worker r: Prometheus on base + r
        a.insert(a.end(), {"--metrics_port", std::to_string(std::stoi(flags["worker_metrics_port_base"]) + r)});
      }
      per_rank.push_back(std::move(a));
    }
    const std::string binary =
        flags.count("worker_binary") ? flags["worker_binary"] : FindWorkerBinary(argv[0]);
    const int timeout = flags.count("worker_start_timeout_s") ? std::stoi(flags["worker_start_timeout_s"]) : 300;
    auto started = ChildServer::StartAll(binary, per_rank, timeout);
    if (!started.ok()) return fail(started.status());
    local = std::move(started).value();
    for (const auto& child : local) addresses.push_back(child.address());
  }
  Coordinator core{options};
  for (const auto& a : addresses) {
    auto client = std::make_unique<GrpcWorkerClient>(a, std::chrono::seconds(worker_call_timeout), worker_token);
    if (auto s = client->WaitReady(60); !s.ok()) return fail(s);
    if (auto s = core.AddWorker(std::move(client)); !s.ok()) return fail(s);
  }
  CoordinatorService service(&core, 4, &metrics, api_keys ? &*api_keys : nullptr);
  service.SetQueueLimits(flags.count("max_queued_per_run") ? std::stoll(flags["max_queued_per_run"]) : 64,
                         flags.count("max_queued") ? std::stoll(flags["max_queued"]) : 4096);
  RegistryService registry(&core, worker_token);
  int port = 0;
  // --tls_cert_file/--tls_key_file: the Trainer API over TLS (workers stay on plaintext
  // loopback or a private network, authenticated by the worker token).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (flags.count("tls_cert_file") || flags.count("tls_key_file")) {
    auto tls = TlsServerCredentials(flags["tls_cert_file"], flags["tls_key_file"]);
    if (!tls.ok()) return fail(tls.status());
    credentials = *tls;
  }
  auto server = StartGrpcServer(host,
                                flags.count("port") ? std::stoi(flags["port"]) : 50051,
                                {&service, &registry}, &port, max_request_bytes,
                                CallObservers{&metrics, log_verbosity, "coordinator", -1}, credentials);
  if (!server.ok()) return fail(server.status());
  // grpc.health.v1 follows the workers: NOT_SERVING while none is up (a mesh: any rank down).
  core.OnServingChange([srv = server->get()](bool serving) { srv->GetHealthCheckService()->SetServingStatus(serving); });
  if (flags.count("port_file")) {
    if (auto s = WritePortFile(flags["port_file"], port); !s.ok()) return fail(s);
  }
  if (addresses.empty()) {
    std::cerr << "lorastep_coordinator: port " << port << ", waiting for workers to register\n";
  } else {
    std::cerr << "lorastep_coordinator: serving " << core.model_path() << " on port " << port
              << " with " << addresses.size() << " worker(s)\n";
  }
  WaitForShutdownSignal();
  std::cerr << "lorastep_coordinator: shutting down\n";
  // Calls still open after the grace period (an idle WatchMetrics stream) are cancelled.
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  for (auto& child : local) child.Stop();
  return 0;
}
