// lorastep_worker: one per GPU (or one CPU process). Loads the base model once and serves
// the internal Worker API.
//   lorastep_worker --model DIR [--device cuda:0] [--dtype bfloat16] [--host 127.0.0.1]
//                   [--port 0] [--port_file F] [--max_tokens_per_microbatch N] [--unfused_wgrad]
//                   [--register_with COORDINATOR_HOST:PORT [--register_every_s 5]] [--advertise_host H]
//                   [--rank R --tp T --pp P --dp D --rendezvous HOST:PORT]
//                   [--collective_timeout_s S] [--state_dir DIR (path fields are
//                   lorastep://<run>/<name> references under DIR; default ~/.local/state/lorastep)]
//                   [--allow_plain_paths (no store: absolute paths)] [--state_ttl_hours H]
//                   [--max_activation_mb M]
#include <ATen/Parallel.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/grpc_status.h"

#include "lib/parent_death.h"
#include "lib/io/state_store.h"
#include "rpc/bearer_token.h"
#include "rpc/security_policy.h"
#include "rpc/metrics_http_server.h"
#include "lib/flags_util.h"
#include "lib/log.h"
#include "lib/status_macros.h"
#include "rpc/server_flags.h"
#include "rpc/server_process.h"
#include "rpc/server_runner.h"
#include "worker/worker_core.h"
#include "lib/io/state_pruner.h"
#include "worker/rendezvous_service.h"
#include "worker/test_hooks.h"
#include "worker/worker_dispatch.h"
#include "worker/worker_pipe_service.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, model, "", "Hugging Face model folder (config.json + safetensors); required");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "", "float32 | bfloat16 | float16 (default: the model's config.json)");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to listen on");
ABSL_FLAG(int, port, 0, "port of the Worker API (0: any free port)");
ABSL_FLAG(std::string, port_file, "", "write the bound port here");
ABSL_FLAG(int, coordinator_pipe_fd, -1,
          "an inherited socket from the coordinator that spawned this worker: its per-step calls arrive there "
          "(set by the coordinator; -1: none)");
ABSL_FLAG(std::optional<int64_t>, max_tokens_per_microbatch, std::nullopt, "padded tokens per micro-batch (default 8192)");
ABSL_FLAG(int64_t, coschedule_window_us, 5000,
          "TrainSteps of different runs queued while the device is busy run as one step; with several runs, a call "
          "finding the device idle waits up to this many microseconds for the others (0: off, every call alone)");
ABSL_FLAG(std::optional<int>, executor_spin_us, std::nullopt,
          "after each call, the thread that ran it polls this long for the run's next call before it sleeps, and so "
          "does this worker's reader of the coordinator's call pipe after each answer "
          "(a training loop's next call comes within a few milliseconds; waking a sleeping thread costs more). "
          "Default: 5000 on a CUDA device, whose host cores idle through the step; 0 on the CPU, whose step "
          "needs them");
ABSL_FLAG(bool, pack_sequences, true, "pack each micro-batch's datums back to back (no padding; attention per sequence)");
ABSL_FLAG(bool, unfused_wgrad, false, "weight gradients through autograd .grad instead of fused main_grad accumulation");
ABSL_FLAG(std::string, register_with, "", "coordinator host:port to register with (and, without --rank, to get a mesh rank from)");
ABSL_FLAG(int, register_every_s, 5, "with --register_with: register again every N seconds (0: once), so a restarted coordinator finds this worker");
ABSL_FLAG(std::string, advertise_host, "", "host the coordinator and peers reach this worker at (default: --host)");
ABSL_FLAG(std::optional<int>, rank, std::nullopt, "this worker's global rank in the mesh");
ABSL_FLAG(int, tp, 1, "tensor-parallel size of the mesh");
ABSL_FLAG(int, pp, 1, "pipeline-parallel size of the mesh");
ABSL_FLAG(int, dp, 1, "data-parallel size of the mesh");
ABSL_FLAG(int, ep, 1, "expert-parallel size of the mesh");
ABSL_FLAG(int, cp, 1, "context-parallel size of the mesh (each sequence's tokens split over cp ranks)");
ABSL_FLAG(std::string, rendezvous, "", "host:port where rank 0 serves the mesh's rendezvous store");
ABSL_FLAG(std::string, peer_tls_ca_file, "",
          "when the mesh's workers serve TLS: roots (PEM) that verify rank 0's rendezvous store (default: "
          "--coordinator_tls_ca_file)");
ABSL_FLAG(std::optional<int>, collective_timeout_s, std::nullopt, "seconds a collective may take (default 120)");
ABSL_FLAG(std::string, state_dir, "",
          "state store root: path fields are lorastep://<run>/<name> references under it (default: "
          "$XDG_STATE_HOME/lorastep, else ~/.local/state/lorastep)");
ABSL_FLAG(bool, allow_plain_paths, false,
          "no state store: path fields are absolute paths on this worker's file system (trusted clients only)");
ABSL_FLAG(std::optional<double>, state_ttl_hours, std::nullopt, "remove lorastep's state-store folders older than this");
ABSL_FLAG(std::optional<double>, max_activation_mb, std::nullopt,
          "MiB one micro-batch's activations may take (0: 80% of free host memory on CPU; -1: off)");
ABSL_FLAG(std::string, activation_recompute, "auto",
          "activation recomputation of a training micro-batch's layers: auto (only when its activations would not "
          "fit --max_activation_mb otherwise: selective where that fits, else full), none, selective (also keeps "
          "the attention output), full");
ABSL_FLAG(std::string, worker_token_file, "",
          "the cluster secret (>= 16 characters) every call to this worker must present (default: "
          "$LORASTEP_CLUSTER_SECRET)");
ABSL_FLAG(bool, insecure, false,
          "refused: a worker's calls always need the cluster secret or a client certificate, and a non-loopback "
          "--host TLS (kept so that scripts passing it are told so)");
ABSL_FLAG(std::string, tls_cert_file, "", "serve the Worker API over TLS: certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key_file, "", "serve the Worker API over TLS: private key (PEM)");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "mutual TLS: callers (the coordinator) must present a certificate signed by this CA (PEM)");
ABSL_FLAG(std::string, coordinator_tls_ca_file, "",
          "the coordinator (--register_with) serves TLS: verify it against this CA (PEM)");
ABSL_FLAG(int, cpu_threads, 0, "intra-op CPU threads (0: LibTorch's default)");
ABSL_FLAG(int64_t, kv_cache_mb, 0,
          "the sampler's key/value cache, MiB, in [0, 1048576] (0: a tenth of the memory available at the first "
          "Sample, the device's or on CPU the host's, at most 4096)");

namespace {

// Announces this worker to a coordinator, retrying while the coordinator starts.
absl::Status RegisterWithCoordinator(const std::string& coordinator, const std::string& self,
                                     int timeout_seconds, const std::string& authorization,
                                     const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  auto channel = grpc::CreateChannel(coordinator, credentials);
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
                                                        const std::string& authorization,
                                                        const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  auto channel = grpc::CreateChannel(coordinator, credentials);
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

// The host the coordinator and peers reach this worker at.
std::string AdvertisedHost() {
  return !absl::GetFlag(FLAGS_advertise_host).empty() ? absl::GetFlag(FLAGS_advertise_host) : absl::GetFlag(FLAGS_host);
}

// Every security decision from the flags, before anything listens: the one policy
// (rpc/security_policy.h), the cluster secret's digest and header, this server's TLS
// credentials and those that verify the coordinator.
struct WorkerSecurity {
  lorastep::SecurityPolicy policy;
  std::string token_sha256, authorization;  // empty without a secret
  std::shared_ptr<grpc::ServerCredentials> server_credentials;  // null: plaintext
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials;
};

// The cluster secret (--worker_token_file, else $LORASTEP_CLUSTER_SECRET, which the
// coordinator sets for its local workers): every call to this worker must present it, and the
// worker presents it when registering or joining a mesh. Without one the worker serves only
// callers with a certificate its --tls_client_ca_file signed.
absl::StatusOr<WorkerSecurity> SecurityFromFlags(const std::string& secret) {
  using namespace lorastep;
  SecurityFlags security;
  security.role = ServerRole::kWorker;
  security.loopback_host = IsLoopbackHost(absl::GetFlag(FLAGS_host));
  security.tls = !absl::GetFlag(FLAGS_tls_cert_file).empty();
  security.client_ca = !absl::GetFlag(FLAGS_tls_client_ca_file).empty();
  security.secret = !secret.empty();
  security.insecure = absl::GetFlag(FLAGS_insecure);
  WorkerSecurity out;
  LORASTEP_ASSIGN_OR_RETURN(out.policy, DecideSecurity(security));
  if (!secret.empty()) {
    out.token_sha256 = Sha256Hex(secret);
    out.authorization = "Bearer " + secret;
  }
  // --coordinator_tls_ca_file: the coordinator's port (its Registry) is TLS.
  LORASTEP_ASSIGN_OR_RETURN(out.coordinator_credentials, ChannelCredentialsFromCa(absl::GetFlag(FLAGS_coordinator_tls_ca_file),
                                                                                  "coordinator_tls_ca_file"));
  // --tls_cert_file/--tls_key_file: the Worker API over TLS.
  if (!absl::GetFlag(FLAGS_tls_cert_file).empty() || !absl::GetFlag(FLAGS_tls_key_file).empty() ||
      !absl::GetFlag(FLAGS_tls_client_ca_file).empty()) {
    LORASTEP_ASSIGN_OR_RETURN(out.server_credentials,
                              TlsServerCredentials(absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
                                                   absl::GetFlag(FLAGS_tls_client_ca_file)));
  }
  return out;
}

// The WorkerCore's options from the flags (and, in the testing build, its fault points).
absl::StatusOr<lorastep::WorkerOptions> OptionsFromFlags(const std::string& secret) {
  using namespace lorastep;
  WorkerOptions options;
  options.model_path = absl::GetFlag(FLAGS_model);
  if (options.model_path.empty()) return absl::InvalidArgumentError("--model is required");
  options.device = absl::GetFlag(FLAGS_device);
  options.dtype = absl::GetFlag(FLAGS_dtype);
  if (auto n = absl::GetFlag(FLAGS_max_tokens_per_microbatch)) options.max_tokens_per_microbatch = *n;
  if (absl::GetFlag(FLAGS_coschedule_window_us) < 0) {
    return absl::InvalidArgumentError("--coschedule_window_us: must be >= 0 microseconds");
  }
  options.coschedule_window = std::chrono::microseconds(absl::GetFlag(FLAGS_coschedule_window_us));
  options.grad.fused_wgrad = !absl::GetFlag(FLAGS_unfused_wgrad);
  options.pack_sequences = absl::GetFlag(FLAGS_pack_sequences);
  LORASTEP_ASSIGN_OR_RETURN(options.state_dir,
                            ServerStateDir(absl::GetFlag(FLAGS_state_dir), absl::GetFlag(FLAGS_allow_plain_paths)));
  // MiB one micro-batch's activations may take (estimated before running; over it the call is
  // RESOURCE_EXHAUSTED). 0 (default): 80% of the available host memory on CPU; -1: off.
  if (const auto mb = absl::GetFlag(FLAGS_max_activation_mb)) options.max_activation_bytes = ActivationBytesFromMb(*mb);
  const int64_t kv_cache_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  if (kv_cache_mb < 0 || kv_cache_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_mb: ", kv_cache_mb, " is not in [0, 1048576]"));
  }
  options.kv_cache_bytes = kv_cache_mb << 20;
  LORASTEP_ASSIGN_OR_RETURN(options.activation_recompute,
                            ParseActivationRecompute(absl::GetFlag(FLAGS_activation_recompute), "--activation_recompute"));
  ProfileFromEnvironment(&options);
  // Mesh: --rank R --tp T --pp P --dp D --rendezvous HOST:PORT [--collective_timeout_s S].
  if (auto rank = absl::GetFlag(FLAGS_rank)) options.rank = *rank;
  options.sizes = {absl::GetFlag(FLAGS_tp), absl::GetFlag(FLAGS_pp), absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_ep),
                   absl::GetFlag(FLAGS_cp)};
  options.rendezvous = absl::GetFlag(FLAGS_rendezvous);
  if (!secret.empty()) options.rendezvous_key_prefix = RendezvousKeyPrefix(secret);
  if (auto timeout = absl::GetFlag(FLAGS_collective_timeout_s)) options.collective_timeout = std::chrono::seconds(*timeout);
  options.gloo_host = AdvertisedHost();
  if (const auto ttl = absl::GetFlag(FLAGS_state_ttl_hours); ttl && (!(*ttl > 0) || options.state_dir.empty())) {
    return absl::InvalidArgumentError(absl::StrCat("state_ttl_hours: '", *ttl,
                                                   "' must be a positive number of hours, with a state store (not "
                                                   "--allow_plain_paths)"));
  }
  // Fault injection, in the testing build only (worker/test_hooks.h).
  LORASTEP_RETURN_IF_ERROR(ApplyTestFlags(&options));
  return options;
}

// --register_with without --rank: a coordinator running a mesh hands out the rank (and sizes,
// rendezvous); one that runs no mesh leaves the worker at world size 1.
absl::Status JoinMeshIfOffered(const WorkerSecurity& security, lorastep::WorkerOptions* options) {
  using namespace lorastep;
  const std::string register_with = absl::GetFlag(FLAGS_register_with);
  if (register_with.empty() || absl::GetFlag(FLAGS_rank)) return absl::OkStatus();
  auto joined = JoinMesh(register_with, AdvertisedHost(), 60, security.authorization, security.coordinator_credentials);
  if (!joined.ok()) {
    const bool no_mesh = absl::IsFailedPrecondition(joined.status()) &&
                         joined.status().message().find("runs no mesh") != absl::string_view::npos;
    return no_mesh ? absl::OkStatus() : joined.status();
  }
  options->rank = joined->rank();
  options->sizes = {joined->tp(), joined->pp(), joined->dp(), std::max(1, joined->ep()), std::max(1, joined->cp())};
  options->rendezvous = joined->rendezvous();
  LORASTEP_LOG(Info) << "lorastep_worker: rank " << options->rank << " of " << options->sizes.world() << ", rendezvous "
                     << options->rendezvous;
  return absl::OkStatus();
}

// The secret is checked on each call's headers, before its message is read: the Worker API,
// reflection and (rank 0 of a mesh across hosts) the rendezvous store.
std::shared_ptr<lorastep::CallAuthenticator> AuthenticatorFor(const WorkerSecurity& security) {
  using namespace lorastep;
  auto authenticator = std::make_shared<CallAuthenticator>();
  if (security.policy.cluster_needs_secret) {
    auto secret_check = [digest = security.token_sha256](const std::string& auth) { return CheckBearerToken(auth, digest); };
    authenticator->Require("/lorastep.v1.Worker/", secret_check);
    authenticator->Require("/lorastep.v1.RendezvousStore/", secret_check);
    authenticator->Require("/grpc.reflection.", secret_check);
  }
  return authenticator;
}

// A mesh across hosts meets at rank 0's rendezvous store, served on the rendezvous port with
// the Worker API's credentials and cluster secret (c10d's TCPStore would answer anyone); the
// other ranks reach it over gRPC. Sets options->store_transport_for; returns rank 0's server
// (null elsewhere, and for local meshes, which meet in a file).
absl::StatusOr<std::unique_ptr<grpc::Server>> ConnectRendezvousStore(
    const WorkerSecurity& security, const std::shared_ptr<lorastep::CallAuthenticator>& authenticator,
    lorastep::RendezvousStoreHost* store_host, lorastep::RendezvousStoreService* store_service,
    lorastep::WorkerOptions* options) {
  using namespace lorastep;
  if (options->sizes.world() <= 1 || options->rendezvous.empty() || absl::StartsWith(options->rendezvous, "file://")) {
    return nullptr;
  }
  if (options->rank != 0) {
    std::string ca_file = absl::GetFlag(FLAGS_peer_tls_ca_file);
    if (ca_file.empty() && !absl::GetFlag(FLAGS_tls_cert_file).empty()) ca_file = absl::GetFlag(FLAGS_coordinator_tls_ca_file);
    LORASTEP_ASSIGN_OR_RETURN(auto peer_credentials, ChannelCredentialsFromCa(ca_file, "peer_tls_ca_file"));
    options->store_transport_for = [credentials = peer_credentials, authorization = security.authorization](
                                       const std::string& address) {
      return GrpcStoreTransport(address, credentials, authorization);
    };
    return nullptr;
  }
  int store_port = 0;
  const size_t colon = options->rendezvous.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(options->rendezvous.substr(colon + 1), &store_port)) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: '", options->rendezvous, "' is not host:port"));
  }
  const std::string host = absl::GetFlag(FLAGS_host);
  int bound = 0;
  auto started = StartGrpcServer(host, store_port, {store_service}, &bound, 4 << 20, CallObservers{},
                                 security.server_credentials, authenticator);
  if (!started.ok()) return absl::Status(started.status().code(), absl::StrCat("rendezvous store: ", started.status().message()));
  LORASTEP_LOG(Info) << "lorastep_worker: rank 0 serves the mesh's rendezvous store on " << host << ":" << bound
                     << (security.token_sha256.empty() ? " (client certificate required)" : " (cluster secret required)");
  options->store_transport_for = [store_host](const std::string&) { return store_host->LocalTransport(); };
  return started;
}

// With --register_with, registers again every --register_every_s until destroyed: a
// coordinator that restarted (and lost its list of workers) finds this worker again and
// re-attaches its journaled runs; one that knows the worker keeps it as it is.
class Reannouncer {
 public:
  Reannouncer(std::string coordinator, std::string self, const WorkerSecurity* security, int every_s) {
    if (coordinator.empty() || every_s <= 0) return;
    thread_ = std::thread([this, coordinator, self, security, every_s] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, std::chrono::seconds(every_s), [&] { return stopping_; })) {
        lock.unlock();
        absl::Status s = RegisterWithCoordinator(coordinator, self, 1, security->authorization,
                                                 security->coordinator_credentials);
        if (!s.ok() && !absl::IsAlreadyExists(s)) LORASTEP_LOG(Warning) << "lorastep_worker: registering again: " << s;
        lock.lock();
      }
    });
  }
  ~Reannouncer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ServerProcess process(argc, argv, "lorastep_worker",
                        "lorastep_worker --model DIR [flags]: one per GPU (or CPU process); serves the internal "
                        "Worker API. See --help for the flags.");
  if (!process.metrics_status().ok()) return process.Fail(process.metrics_status());
  auto secret = ClusterSecretFromFileOrEnvironment(absl::GetFlag(FLAGS_worker_token_file));
  unsetenv(kClusterSecretVariable);  // nothing this process starts inherits it
  if (!secret.ok()) return process.Fail(secret.status());
  auto security = SecurityFromFlags(*secret);
  if (!security.ok()) return process.Fail(security.status());
  auto options = OptionsFromFlags(*secret);
  if (!options.ok()) return process.Fail(options.status());
  const int executor_spin_us =
      absl::GetFlag(FLAGS_executor_spin_us).value_or(absl::StartsWith(absl::GetFlag(FLAGS_device), "cuda") ? 5000 : 0);
  if (executor_spin_us < 0 || executor_spin_us > 100000) {
    return process.Fail(absl::InvalidArgumentError("--executor_spin_us: must be in [0, 100000]"));
  }
  // More intra-op threads do not speed up CUDA ranks (docs/PERFORMANCE.md): left to the operator.
  if (const int threads = absl::GetFlag(FLAGS_cpu_threads); threads > 0) at::set_num_threads(threads);
  if (absl::Status joined = JoinMeshIfOffered(*security, &*options); !joined.ok()) return process.Fail(joined, 1);
  auto authenticator = AuthenticatorFor(*security);
  RendezvousStoreHost rendezvous_host;
  RendezvousStoreService rendezvous_service(&rendezvous_host);
  auto rendezvous_server = ConnectRendezvousStore(*security, authenticator, &rendezvous_host, &rendezvous_service, &*options);
  if (!rendezvous_server.ok()) return process.Fail(rendezvous_server.status(), 1);
  // Every rank of a mesh traces its own step: rank r > 0 writes TRACE.rank<r>.
  if (!options->profile_trace_path.empty() && options->rank > 0) {
    options->profile_trace_path += absl::StrCat(".rank", options->rank);
  }
  auto core = WorkerCore::Create(*options);
  if (!core.ok()) return process.Fail(core.status(), 1);
  WorkerDispatch dispatch(core->get(), process.metrics(), /*device_call_threads=*/64,
                          std::chrono::microseconds(executor_spin_us));
  WorkerService service(&dispatch, security->token_sha256);
  int port = 0;
  CallObservers observers{process.metrics(), VerbosityFlag(), "worker", options->sizes.world() > 1 ? options->rank : -1};
  observers.services = {"lorastep.v1.Worker"};
  auto server = StartGrpcServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_port), {&service}, &port, 1 << 30,
                                observers, security->server_credentials, authenticator);
  if (!server.ok()) return process.Fail(server.status(), 1);
  std::unique_ptr<WorkerPipeService> pipe;
  if (const int fd = absl::GetFlag(FLAGS_coordinator_pipe_fd); fd != -1) {
    auto started = WorkerPipeService::Start(fd, &dispatch, &observers, WorkerPipeService::kMaxCallBytes,
                                            std::chrono::microseconds(executor_spin_us));
    if (!started.ok()) return process.Fail(started.status());
    pipe = *std::move(started);
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    if (auto s = WritePortFile(absl::GetFlag(FLAGS_port_file), port); !s.ok()) return process.Fail(s, 1);
  }
  LORASTEP_LOG(Info) << "lorastep_worker: serving " << options->model_path << " on port " << port << " ("
                     << (*core)->base().device.str() << ")";
  const std::string register_with = absl::GetFlag(FLAGS_register_with);
  const std::string self = absl::StrCat(AdvertisedHost(), ":", port);
  if (!register_with.empty()) {
    if (auto s = RegisterWithCoordinator(register_with, self, 60, security->authorization,
                                         security->coordinator_credentials);
        !s.ok()) {
      (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
      return process.Fail(s, 1);
    }
  }
  // --state_ttl_hours: lorastep's folders in the state store older than this are removed,
  // checked every tenth of the TTL (1 s to 10 min); one pruner per store (rank 0).
  std::optional<StatePruner> pruner;
  if (const auto ttl = absl::GetFlag(FLAGS_state_ttl_hours); ttl && options->rank == 0) {
    pruner.emplace(options->state_dir, static_cast<int64_t>(*ttl * 3600));
  }
  auto announcer = std::make_unique<Reannouncer>(register_with, self, &*security, absl::GetFlag(FLAGS_register_every_s));
  // Calls still open after 3 s are cancelled, and a cancelled batch call stops at its next
  // micro-batch; a call stuck in a collective or a device kernel does not hold the exit.
  process.ServeUntilShutdownSignal(std::chrono::seconds(10));
  announcer.reset();
  pruner.reset();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
  pipe.reset();  // its calls still running are cancelled, and stop at their next micro-batch
  return 0;
}
