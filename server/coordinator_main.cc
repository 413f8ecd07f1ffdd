// lorastep_coordinator: the public Trainer API. By default it starts one local worker
// process on the given model; with --workers it uses running workers instead; with
// --wait_for_workers it starts with none and waits for workers to register
// (lorastep_worker --register_with this address).
//   lorastep_coordinator --model DIR [--device cpu] [--dtype D] [--port 50051] [--host 127.0.0.1]
//                        [--port_file F] [--workers host:port,host:port] [--wait_for_workers]
//                        [--worker_binary PATH] [--max_tokens_per_microbatch N] [--in_process_worker]
//                        [--worker_start_timeout_s 300]
//                        [--tp T --pp P --dp D] [--collective_timeout_s S] [--peer_failure_grace_s G]
//                        [--worker_call_timeout_s 3600] [--rendezvous_port 29500]
//                        [--state_dir DIR: checkpoints and exports as lorastep://<run>/<name>
//                        references under DIR, passed to local workers, and the journal under
//                        DIR/.journal; default ~/.local/state/lorastep/port-<port> (--port 0:
//                        ~/.local/state/lorastep, no journal)] [--allow_plain_paths: no store]
//                        [--metrics_port P [--metrics_host 127.0.0.1] [--metrics_allow_remote]
//                        [--metrics_port_file F]: Prometheus text format at GET /metrics]
//                        [--worker_metrics_port_base B: local worker r serves its own on B + r]
//                        [--v 1: per-call log lines on stderr; 0 failures only, 2 with health checks]
//                        [--api_keys_file F: lines "KEY OWNER [admin]"; calls need "authorization:
//                        Bearer KEY" and see only their owner's runs] [--insecure]
//                        [--worker_token_file F: shared secret for the Worker port and the Registry]
//                        [--tls_cert_file C --tls_key_file K: the Trainer API over TLS (PEM)]
//                        [--max_queued_per_run 64] [--max_queued_per_key 1024] [--max_queued 4096]
//                        [--max_queued_mb_per_key 512] [--max_queued_mb 2048]: calls and request bytes
//                        in flight beyond them are RESOURCE_EXHAUSTED naming the flag, with retry advice
//                        [--max_watch_backlog 1024]: step records held for a slow WatchMetrics client
// With --wait_for_workers and --tp/--pp/--dp, workers started with --register_with and no
// --rank get their ranks here in the order they ask (JoinMesh); rank 0 serves the
// rendezvous at its host and --rendezvous_port.
// With --tp/--pp/--dp (default 1) it starts tp*pp*dp local workers, rank r on cuda:r (or a
// CPU process each), forming one mesh; with --workers the listed workers must be the ranks
// of such a mesh (started with matching --rank/--tp/--pp/--dp/--rendezvous).
#include <algorithm>
#include <atomic>
#include <future>
#include <thread>
#include <tuple>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "lib/training/batch.h"
#include "lib/parent_death.h"
#include "lib/io/file_util.h"
#include "lib/io/state_store.h"
#include "lib/parallel/parallel_layout.h"
#include "rpc/metrics_http_server.h"
#include "rpc/bearer_token.h"
#include "rpc/security_policy.h"
#include "server/tinker_serving.h"
#include "server/api_keys.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/grpc_worker_client.h"
#include "server/local_mesh.h"
#include "server/local_workers.h"
#include "server/registry_service.h"
#include "server/run_journal.h"
#include "server/child_server.h"
#include "server/in_process_worker_start.h"
#include "lib/io/state_pruner.h"
#include "lib/flags_util.h"
#include "lib/log.h"
#include "lib/status_macros.h"
#include "rpc/server_flags.h"
#include "rpc/server_process.h"
#include "rpc/server_runner.h"

ABSL_FLAG(std::string, model, "", "model folder for the local worker(s)");
ABSL_FLAG(std::string, device, "cpu", "local workers' device: cpu or cuda (rank r on cuda:r)");
ABSL_FLAG(std::string, dtype, "", "local workers' dtype (default: the model's config.json)");
ABSL_FLAG(int, port, 50051, "port of the Trainer API (0: any free port)");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to listen on (non-loopback needs --api_keys_file)");
ABSL_FLAG(std::string, port_file, "", "write the bound port here");
ABSL_FLAG(std::string, workers, "", "use running workers host:port,host:port instead of starting local ones");
ABSL_FLAG(bool, wait_for_workers, false, "start with no worker and wait for workers to register");
ABSL_FLAG(std::string, worker_binary, "", "lorastep_worker to start (default: beside this binary)");
ABSL_FLAG(bool, in_process_worker, false,
          "run the local worker inside this process (world size 1): no second gRPC hop per call, but a worker "
          "crash ends the coordinator, which then cannot restart it");
ABSL_FLAG(bool, worker_pipe, true,
          "local worker processes: their per-step calls (TrainStep, ForwardBackward, Forward, OptimStep) travel over a "
          "socket pair each inherits at spawn instead of gRPC (every other call stays on gRPC)");
ABSL_FLAG(std::optional<bool>, worker_pipe_poll, std::nullopt,
          "the call pipe's waiting caller polls for each answer inside the window it is expected in (the method's "
          "last three durations, at most 20 ms wide) instead of sleeping through the step, at the cost of up to that "
          "window of one core per call (default: on with --device cuda)");
ABSL_FLAG(std::optional<int>, grpc_poller_warm_us, std::nullopt,
          "after each answer, gRPC alarms every 50 us keep the server's polling thread stirring for this long, so the "
          "training loop's next call does not wait for a poller that slept through the step (a few microseconds of "
          "CPU per alarm). Default: 3000 with --device cuda, else 0 (off)");
ABSL_FLAG(std::optional<int64_t>, max_tokens_per_microbatch, std::nullopt, "local workers: padded tokens per micro-batch");
ABSL_FLAG(int, worker_start_timeout_s, 300, "seconds local workers may take to start");
ABSL_FLAG(int, tp, 1, "tensor-parallel size of the mesh");
ABSL_FLAG(int, pp, 1, "pipeline-parallel size of the mesh");
ABSL_FLAG(int, dp, 1, "data-parallel size of the mesh");
ABSL_FLAG(int, ep, 1, "expert-parallel size of the mesh");
ABSL_FLAG(int, max_local_workers, 16,
          "CPU: the most local worker processes a mesh may start (each holds a copy of its model shard); with "
          "--device cuda the visible GPUs bound it (one per rank)");
ABSL_FLAG(int, cp, 1, "context-parallel size of the mesh (each sequence's tokens split over cp ranks)");
ABSL_FLAG(std::optional<int>, collective_timeout_s, std::nullopt, "local workers: seconds a collective may take (default 120)");
ABSL_FLAG(std::optional<int>, peer_failure_grace_s, std::nullopt,
          "seconds the other ranks of a failed mesh call may still take (default: collective timeout + 30)");
ABSL_FLAG(int, worker_call_timeout_s, 3600, "deadline of one call to a worker");
ABSL_FLAG(double, worker_health_interval_s, 2,
          "ask every worker this often whether its process is there (Worker.Info): a worker whose process is "
          "gone is marked down (health NOT_SERVING, a restart or the wait for its replacement begins) without "
          "waiting for a call to find it; 0: only calls find dead workers");
ABSL_FLAG(int, rendezvous_port, 29500,
          "port rank 0 serves the mesh's rendezvous store on (behind the cluster secret) when workers join by registration");
ABSL_FLAG(std::string, state_dir, "",
          "state store root (checkpoints and exports as lorastep://<run>/<name>), passed to local workers; it "
          "turns on the journal (default: <root>/port-<port> on a fixed --port, <root> with --port 0 (no "
          "journal); <root> is $XDG_STATE_HOME/lorastep, else ~/.local/state/lorastep)");
ABSL_FLAG(bool, allow_plain_paths, false,
          "local workers keep no state store: path fields are absolute paths on their file system (trusted "
          "clients only)");
ABSL_FLAG(std::optional<double>, state_ttl_hours, std::nullopt, "local workers: remove lorastep's state-store folders older than this");
ABSL_FLAG(std::optional<int>, worker_metrics_port_base, std::nullopt, "local worker r serves Prometheus metrics on this + r");
ABSL_FLAG(std::string, api_keys_file, "", "lines \"KEY OWNER [admin]\"; calls then need a key and see only their owner's runs");
ABSL_FLAG(bool, insecure, false,
          "serve the Trainer API on a non-loopback --host (over TLS) without API keys (trusted networks only); it opens "
          "nothing else: the Registry and workers always need the cluster secret or mutual TLS");
ABSL_FLAG(bool, allow_unauthenticated_remote, false, "the former name of --insecure");
ABSL_FLAG(std::string, worker_token_file, "",
          "the cluster secret (>= 16 characters) for the Worker ports and the Registry; default: "
          "$LORASTEP_CLUSTER_SECRET, else one made at start for local workers");
ABSL_FLAG(std::string, tls_cert_file, "", "the Trainer API over TLS: certificate chain (PEM)");
ABSL_FLAG(std::string, tls_key_file, "", "the Trainer API over TLS: private key (PEM)");
ABSL_FLAG(std::string, worker_tls_ca_file, "",
          "workers serve TLS (their --tls_cert_file): verify them against this CA (PEM); default plaintext");
ABSL_FLAG(std::string, worker_tls_cert_file, "", "local workers serve TLS with this certificate chain (PEM)");
ABSL_FLAG(std::string, worker_tls_key_file, "", "local workers serve TLS with this private key (PEM)");
ABSL_FLAG(std::string, worker_tls_client_cert_file, "",
          "mutual TLS: the certificate (PEM) this coordinator presents to workers (local workers then require "
          "one signed by --worker_tls_ca_file)");
ABSL_FLAG(std::string, worker_tls_client_key_file, "", "mutual TLS: the private key of --worker_tls_client_cert_file");
ABSL_FLAG(int64_t, max_queued_per_run, 64, "calls queued on one run beyond which RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queued_per_key, 1024,
          "calls one API key's owner (every caller, without --api_keys_file) may have queued; below --max_queued");
ABSL_FLAG(int64_t, max_queued, 4096, "calls queued in all beyond which RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queued_mb_per_key, 512,
          "MiB of request bodies one API key's calls may hold from the moment each is read until it is answered; "
          "below --max_queued_mb, at least --max_upload_mb");
ABSL_FLAG(int64_t, max_queued_mb, 2048, "MiB of request bodies all calls in flight may hold");
ABSL_FLAG(int64_t, max_watch_backlog, 1024,
          "step records a WatchMetrics stream holds for a slow client; beyond it the stream ends (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, max_runs, 256, "runs that may exist");
ABSL_FLAG(int, max_runs_per_key, 64, "runs one API key's owner may hold at once (with --api_keys_file)");
ABSL_FLAG(int, max_request_mb, 64, "largest request a client may send, MiB, in [1, 1024]");
ABSL_FLAG(int, max_upload_mb, 512, "largest PEFT adapter one UploadAdapter may send (both files), MiB, in [1, 1000]");
ABSL_FLAG(double, max_recorded_mb, 64, "MiB of recorded responses (for retries) kept per run");
ABSL_FLAG(std::optional<double>, max_activation_mb, std::nullopt, "local workers: activation budget per micro-batch, MiB");
ABSL_FLAG(std::string, activation_recompute, "auto", "local workers: activation recomputation (auto, none, selective, full)");
ABSL_FLAG(int64_t, coschedule_window_us, 5000,
          "local workers: how long a TrainStep finding the device idle waits for other runs' calls to share its step "
          "(0: off)");
ABSL_FLAG(bool, unfused_wgrad, false, "local workers: unfused weight gradients");
ABSL_FLAG(bool, pack_sequences, true, "local workers: pack each micro-batch's datums back to back (no padding)");
ABSL_FLAG(int, cpu_threads, 0, "local workers: intra-op CPU threads (0: the worker's default)");
ABSL_FLAG(int64_t, kv_cache_mb, 0, "local workers: the sampler's key/value cache, MiB (0: the worker's default)");
ABSL_FLAG(std::string, journal_dir, "",
          "journal runs here so a restarted coordinator brings them back (needs --state_dir for the "
          "workers' autosaves; not with --wait_for_workers)");
ABSL_FLAG(bool, journal, true,
          "with a state store (--state_dir, or the default one of a fixed --port) and local workers, journal "
          "runs under <state_dir>/.journal unless --journal_dir says where; --nojournal: runs live in memory only");
ABSL_FLAG(bool, autosave_in_background, true,
          "with a journal: workers copy a run's state to host memory on the step's path and write the "
          "autosave afterwards (--noautosave_in_background: the step waits for the disk)");
ABSL_FLAG(int, autosave_every_full_steps, 50,
          "with a journal: the same for full fine-tuning runs (rank 0: the whole model and its optimizer)");
ABSL_FLAG(std::optional<int>, executor_spin_us, std::nullopt,
          "after each training call, an executor thread polls this long for the run's next call before it "
          "sleeps (a training loop sends the next call at once; waking a sleeping thread costs more); one "
          "thread polls at a time. Default: 2000 with --device cuda, 0 on the CPU (a CPU worker's step needs "
          "the cores)");
ABSL_FLAG(std::optional<int>, autosave_every_steps, std::nullopt,
          "with a journal: save a run's worker state after every N optimizer steps; 0: spaced by cost, so "
          "autosaves take at most --autosave_max_share of a run's time (one taking d seconds comes at most every "
          "d / share seconds). Default: 1 with an explicit --state_dir or --journal_dir, 0 with the default "
          "journal of a fixed --port");
ABSL_FLAG(double, autosave_max_share, 0.1, "with --autosave_every_steps 0: the share of a run's time autosaves may take");
ABSL_FLAG(double, autosave_when_idle_s, 3,
          "with a journal: a run whose last step the spacing left unsaved is autosaved once no call has changed it "
          "for this many seconds (0: never)");

namespace {

// SIGTERM drains within this many seconds, then the coordinator exits anyway.
constexpr int kShutdownDeadlineSeconds = 60;

// --in_process_worker: the local worker's settings from this coordinator's flags (the ones
// it would pass to a lorastep_worker process), then the worker itself (this binary's
// StartInProcessWorker). Flags about a worker process or port are refused rather than ignored.
absl::StatusOr<std::unique_ptr<lorastep::WorkerClient>> StartLocalWorkerInProcess(int world, const std::string& state_dir) {
  using namespace lorastep;
  for (const auto& [set, flag] : std::vector<std::pair<bool, const char*>>{
           {world != 1, "tp/pp/dp/ep (a mesh's ranks are processes)"},
           {!absl::GetFlag(FLAGS_workers).empty(), "workers"},
           {absl::GetFlag(FLAGS_wait_for_workers), "wait_for_workers"},
           {!absl::GetFlag(FLAGS_worker_binary).empty(), "worker_binary"},
           {absl::GetFlag(FLAGS_worker_metrics_port_base).has_value(), "worker_metrics_port_base"},
           {!absl::GetFlag(FLAGS_worker_tls_cert_file).empty(), "worker_tls_cert_file"}}) {
    if (set) {
      return absl::InvalidArgumentError(
          absl::StrCat("in_process_worker: cannot be combined with --", flag, " (it has no worker process)"));
    }
  }
  InProcessWorkerSettings settings;
  settings.model = absl::GetFlag(FLAGS_model);
  settings.device = absl::GetFlag(FLAGS_device);
  settings.dtype = absl::GetFlag(FLAGS_dtype);
  settings.state_dir = state_dir;
  settings.max_tokens_per_microbatch = absl::GetFlag(FLAGS_max_tokens_per_microbatch);
  settings.unfused_wgrad = absl::GetFlag(FLAGS_unfused_wgrad);
  settings.pack_sequences = absl::GetFlag(FLAGS_pack_sequences);
  settings.max_activation_mb = absl::GetFlag(FLAGS_max_activation_mb);
  settings.activation_recompute = absl::GetFlag(FLAGS_activation_recompute);
  settings.coschedule_window_us = absl::GetFlag(FLAGS_coschedule_window_us);
  settings.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  return lorastep::StartInProcessWorker(settings);
}

// A flag of seconds (fractions allowed) in [0, max_s], as a duration; INVALID_ARGUMENT
// naming the flag otherwise (NaN included).
absl::StatusOr<std::chrono::milliseconds> SecondsFlag(double seconds, const char* flag, double max_s) {
  if (!(seconds >= 0 && seconds <= max_s)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", seconds, " must be in [0, ", max_s, "] seconds"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// The cluster secret (--worker_token_file, else $LORASTEP_CLUSTER_SECRET, else made here for
// local workers): RegisterWorker, JoinMesh and every Worker call need it. Local workers
// inherit it through the environment, set before any thread starts.
absl::StatusOr<std::string> ClusterSecretForWorkers() {
  using namespace lorastep;
  LORASTEP_ASSIGN_OR_RETURN(std::string secret, ClusterSecretFromFileOrEnvironment(absl::GetFlag(FLAGS_worker_token_file)));
  if (secret.empty() && absl::GetFlag(FLAGS_workers).empty() && !absl::GetFlag(FLAGS_wait_for_workers)) {
    LORASTEP_ASSIGN_OR_RETURN(secret, NewClusterSecret());
  }
  if (!secret.empty()) setenv(kClusterSecretVariable, secret.c_str(), /*overwrite=*/1);
  return secret;
}

bool OnCuda() { return absl::StartsWith(absl::GetFlag(FLAGS_device), "cuda"); }

// The serving threads' polling, the call limits and the upload bound, from the flags.
struct ServiceSettings {
  int poller_warm_us = 0, executor_spin_us = 0;
  int max_request_bytes = 0;
  lorastep::AdmissionLimits admission;
  int64_t max_upload_bytes = 0;
};

absl::StatusOr<ServiceSettings> ServiceSettingsFromFlags() {
  using namespace lorastep;
  ServiceSettings s;
  s.poller_warm_us = absl::GetFlag(FLAGS_grpc_poller_warm_us).value_or(OnCuda() ? 3000 : 0);
  if (s.poller_warm_us < 0 || s.poller_warm_us > 100000) {
    return absl::InvalidArgumentError("grpc_poller_warm_us: must be in [0, 100000]");
  }
  s.executor_spin_us = absl::GetFlag(FLAGS_executor_spin_us).value_or(OnCuda() ? 2000 : 0);
  if (s.executor_spin_us < 0 || s.executor_spin_us > 100000) {
    return absl::InvalidArgumentError("executor_spin_us: must be in [0, 100000]");
  }
  if (absl::GetFlag(FLAGS_coschedule_window_us) < 0) {
    return absl::InvalidArgumentError("coschedule_window_us: must be >= 0 microseconds");
  }
  // The local worker parses it too; checked here so a bad value stops the coordinator at once.
  LORASTEP_RETURN_IF_ERROR(
      ParseActivationRecompute(absl::GetFlag(FLAGS_activation_recompute), "activation_recompute").status());
  // The largest request a client may send (MiB).
  const int max_request_mb = absl::GetFlag(FLAGS_max_request_mb);
  if (max_request_mb < 1 || max_request_mb > 1024) return absl::InvalidArgumentError("--max_request_mb: must be in [1, 1024]");
  s.max_request_bytes = max_request_mb << 20;
  // Admission (server/admission.h): a key's shares below the whole, an upload within a key's bytes.
  s.admission.calls_per_run = absl::GetFlag(FLAGS_max_queued_per_run);
  s.admission.calls_per_key = absl::GetFlag(FLAGS_max_queued_per_key);
  s.admission.calls_total = absl::GetFlag(FLAGS_max_queued);
  for (const auto& [mb, flag, out] :
       {std::tuple<int64_t, const char*, int64_t*>{absl::GetFlag(FLAGS_max_queued_mb_per_key), "max_queued_mb_per_key",
                                                  &s.admission.bytes_per_key},
        {absl::GetFlag(FLAGS_max_queued_mb), "max_queued_mb", &s.admission.bytes_total}}) {
    if (mb < 1 || mb > (int64_t{1} << 30)) return absl::InvalidArgumentError(absl::StrCat(flag, ": must be in [1, 2^30] MiB"));
    *out = mb << 20;
  }
  LORASTEP_RETURN_IF_ERROR(s.admission.Check());
  // A worker receives the adapter in one message (its limit is 1 GiB).
  const int max_upload_mb = absl::GetFlag(FLAGS_max_upload_mb);
  if (max_upload_mb < 1 || max_upload_mb > 1000) return absl::InvalidArgumentError("max_upload_mb: must be in [1, 1000]");
  s.max_upload_bytes = int64_t{max_upload_mb} << 20;
  if (s.max_upload_bytes > s.admission.bytes_per_key) {
    return absl::InvalidArgumentError(absl::StrCat("max_upload_mb: ", max_upload_mb, " is more than --max_queued_mb_per_key (",
                                                   s.admission.bytes_per_key >> 20,
                                                   "): an upload counts against its key's bytes"));
  }
  return s;
}

// One decision from every security flag, before anything listens (rpc/security_policy.h).
absl::StatusOr<lorastep::SecurityPolicy> SecurityFromFlags(const std::string& worker_token, bool api_keys) {
  using namespace lorastep;
  const bool listed = !absl::GetFlag(FLAGS_workers).empty();
  SecurityFlags security;
  security.role = ServerRole::kCoordinator;
  security.loopback_host = IsLoopbackHost(absl::GetFlag(FLAGS_host));
  security.tls = !absl::GetFlag(FLAGS_tls_cert_file).empty();
  security.secret = !worker_token.empty();
  security.api_keys = api_keys;
  security.insecure = absl::GetFlag(FLAGS_insecure) || absl::GetFlag(FLAGS_allow_unauthenticated_remote);
  security.workers = listed                                ? WorkerSource::kListed
                     : absl::GetFlag(FLAGS_wait_for_workers) ? WorkerSource::kRegistered
                                                             : WorkerSource::kLocal;
  security.listed_workers_mtls = !absl::GetFlag(FLAGS_worker_tls_client_cert_file).empty();
  return DecideSecurity(security);
}

// The Coordinator's mesh, bounds and failure handling from the flags.
absl::StatusOr<lorastep::CoordinatorOptions> CoordinatorOptionsFromFlags() {
  using namespace lorastep;
  CoordinatorOptions options;
  options.mesh = {absl::GetFlag(FLAGS_tp), absl::GetFlag(FLAGS_pp), absl::GetFlag(FLAGS_dp), absl::GetFlag(FLAGS_ep),
                  absl::GetFlag(FLAGS_cp)};
  LORASTEP_RETURN_IF_ERROR(CheckMeshSizes(options.mesh));
  LORASTEP_RETURN_IF_ERROR(ParallelLayout::Create(options.mesh, options.mesh.world()).status());
  options.rendezvous_port = absl::GetFlag(FLAGS_rendezvous_port);
  options.mesh_by_registration = options.mesh.world() > 1 && absl::GetFlag(FLAGS_wait_for_workers);
  if (absl::GetFlag(FLAGS_max_runs) < 1 || !(absl::GetFlag(FLAGS_max_recorded_mb) >= 0)) {
    return absl::InvalidArgumentError("--max_runs must be >= 1 and --max_recorded_mb >= 0");
  }
  options.max_runs = static_cast<size_t>(absl::GetFlag(FLAGS_max_runs));
  options.max_runs_per_owner = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_runs_per_key)));
  options.max_recorded_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_recorded_mb) * (1 << 20));
  // A rank that fails on its own makes its peers fail at their collective timeout (the
  // worker's default is 120 s); past that plus 30 s their calls are cancelled.
  options.peer_failure_grace = std::chrono::seconds(absl::GetFlag(FLAGS_peer_failure_grace_s).value_or(
      absl::GetFlag(FLAGS_collective_timeout_s).value_or(120) + 30));
  LORASTEP_ASSIGN_OR_RETURN(options.worker_health_interval,
                            SecondsFlag(absl::GetFlag(FLAGS_worker_health_interval_s), "worker_health_interval_s", 3600));
  return options;
}

// Where runs are kept: the local workers' state store and, with a journal, the autosaves a
// restart resumes from. Without --state_dir a coordinator on a fixed port keeps its store and
// journal under <default root>/port-<port>: started again on that port it finds its runs, and
// two coordinators on one machine never restore each other's runs or overwrite each other's
// autosaves. --port 0 names no instance: the default root, no journal.
struct RunStorage {
  std::string state_dir;  // empty with --allow_plain_paths
  std::optional<lorastep::RunJournal> journal;
};

absl::Status OpenRunStorage(lorastep::CoordinatorOptions* options, RunStorage* storage) {
  using namespace lorastep;
  const bool explicit_state = !absl::GetFlag(FLAGS_state_dir).empty() || !absl::GetFlag(FLAGS_journal_dir).empty();
  std::string state_root = absl::GetFlag(FLAGS_state_dir);
  if (state_root.empty() && !absl::GetFlag(FLAGS_allow_plain_paths) && absl::GetFlag(FLAGS_port) != 0) {
    state_root = absl::StrCat(DefaultStateDir(), "/port-", absl::GetFlag(FLAGS_port));
  }
  LORASTEP_ASSIGN_OR_RETURN(storage->state_dir, ServerStateDir(state_root, absl::GetFlag(FLAGS_allow_plain_paths)));
  const bool registered = absl::GetFlag(FLAGS_wait_for_workers);
  const bool listed = !absl::GetFlag(FLAGS_workers).empty();
  std::string journal_dir = absl::GetFlag(FLAGS_journal_dir);
  if (journal_dir.empty() && absl::GetFlag(FLAGS_journal) && !state_root.empty() && !listed && !registered) {
    journal_dir = state_root + "/.journal";  // on by default with a state root
  }
  const int autosave_every = absl::GetFlag(FLAGS_autosave_every_steps).value_or(explicit_state ? 1 : 0);
  const double autosave_share = absl::GetFlag(FLAGS_autosave_max_share);
  if (!(autosave_share > 0 && autosave_share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("autosave_max_share: ", autosave_share, " must be in (0, 1]"));
  }
  LORASTEP_ASSIGN_OR_RETURN(auto autosave_idle,
                            SecondsFlag(absl::GetFlag(FLAGS_autosave_when_idle_s), "autosave_when_idle_s", 86400));
  if (journal_dir.empty()) return absl::OkStatus();
  // Registered and listed workers bring their own state stores (a mesh's ranks share one).
  if (autosave_every < 0 || (!listed && !registered && storage->state_dir.empty())) {
    return absl::InvalidArgumentError(
        "journal_dir: needs --state_dir (where the local workers autosave runs), --workers or "
        "--wait_for_workers (workers started with their own --state_dir), and --autosave_every_steps >= 0");
  }
  LORASTEP_ASSIGN_OR_RETURN(storage->journal, RunJournal::Open(journal_dir));
  options->journal = &*storage->journal;
  options->autosave_every_steps = autosave_every;
  options->autosave_max_share = autosave_share;
  options->autosave_every_full_steps = std::max(1, absl::GetFlag(FLAGS_autosave_every_full_steps));
  options->autosave_in_background = absl::GetFlag(FLAGS_autosave_in_background);
  options->autosave_when_idle = autosave_idle;
  LORASTEP_LOG(Info) << "lorastep_coordinator: journal " << journal_dir << ", state store " << storage->state_dir
                     << ", autosave every " << (autosave_every > 0 ? absl::StrCat(autosave_every) : "cost-spaced")
                     << " LoRA / " << options->autosave_every_full_steps << " full fine-tuning steps"
                     << (options->autosave_in_background ? ", written in the background" : "");
  return absl::OkStatus();
}

// Worker-port TLS: the CA the coordinator verifies workers with, and (mutual TLS) the
// certificate it presents to them.
absl::StatusOr<lorastep::WorkerTls> WorkerTlsFromFlags() {
  using namespace lorastep;
  WorkerTls worker_tls;
  for (const auto& [path, flag, kind, out] :
       {std::tuple<std::string, const char*, PemKind, std::string*>{
            absl::GetFlag(FLAGS_worker_tls_ca_file), "worker_tls_ca_file", PemKind::kCertificate, &worker_tls.ca_pem},
        {absl::GetFlag(FLAGS_worker_tls_client_cert_file), "worker_tls_client_cert_file", PemKind::kCertificate,
         &worker_tls.client_cert_pem},
        {absl::GetFlag(FLAGS_worker_tls_client_key_file), "worker_tls_client_key_file", PemKind::kPrivateKey,
         &worker_tls.client_key_pem}}) {
    if (path.empty()) continue;
    LORASTEP_ASSIGN_OR_RETURN(*out, ReadPemFile(path, flag, kind));
  }
  if (worker_tls.client_cert_pem.empty() != worker_tls.client_key_pem.empty() ||
      (!worker_tls.client_cert_pem.empty() && worker_tls.ca_pem.empty())) {
    return absl::InvalidArgumentError(
        "worker_tls_client_cert_file: needs --worker_tls_client_key_file and --worker_tls_ca_file");
  }
  if (absl::GetFlag(FLAGS_worker_tls_cert_file).empty() != absl::GetFlag(FLAGS_worker_tls_key_file).empty() ||
      (!absl::GetFlag(FLAGS_worker_tls_cert_file).empty() && worker_tls.ca_pem.empty())) {
    return absl::InvalidArgumentError(
        "worker_tls_cert_file: needs --worker_tls_key_file and --worker_tls_ca_file (to verify the local workers)");
  }
  return worker_tls;
}

// The local workers' flags, rank by rank (the mesh's rendezvous is LocalWorkers'), after the
// mesh's sizes are checked against the machine and the model: nothing starts that cannot run.
absl::StatusOr<std::vector<std::vector<std::string>>> LocalWorkerFlags(const lorastep::ParallelSizes& mesh,
                                                                       const std::string& state_dir,
                                                                       const lorastep::WorkerTls& worker_tls) {
  using namespace lorastep;
  std::vector<std::string> args = {"--model", absl::GetFlag(FLAGS_model)};
  std::vector<std::string> passed = WorkerTestFlagNames();
  passed.insert(passed.end(), {"dtype", "max_tokens_per_microbatch", "collective_timeout_s", "v", "state_ttl_hours",
                               "max_activation_mb", "activation_recompute", "coschedule_window_us", "unfused_wgrad",
                               "pack_sequences", "cpu_threads", "kv_cache_mb"});
  for (std::string& arg : NonDefaultFlagArgs(passed)) args.push_back(std::move(arg));
  if (state_dir.empty()) {
    args.push_back("--allow_plain_paths");
  } else {
    args.insert(args.end(), {"--state_dir", state_dir});
  }
  if (!absl::GetFlag(FLAGS_worker_tls_cert_file).empty()) {
    args.insert(args.end(), {"--tls_cert_file", absl::GetFlag(FLAGS_worker_tls_cert_file), "--tls_key_file",
                             absl::GetFlag(FLAGS_worker_tls_key_file)});
    if (!worker_tls.client_cert_pem.empty()) {  // mutual TLS: only this coordinator's certificate
      args.insert(args.end(), {"--tls_client_ca_file", absl::GetFlag(FLAGS_worker_tls_ca_file)});
    }
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  const bool cuda = OnCuda();
  const int world = mesh.world();
  if (world > 1 || mesh.ep > 1) {
    const int slots = cuda ? VisibleCudaDevices() : absl::GetFlag(FLAGS_max_local_workers);
    LORASTEP_RETURN_IF_ERROR(
        CheckLocalMesh(mesh, absl::GetFlag(FLAGS_model), slots, cuda ? "the GPUs this machine shows" : "--max_local_workers"));
  }
  std::vector<std::vector<std::string>> per_rank;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--device", cuda && world > 1 ? absl::StrCat("cuda:", r) : device});
    if (world > 1) {
      a.insert(a.end(), {"--rank", std::to_string(r), "--tp", std::to_string(mesh.tp), "--pp", std::to_string(mesh.pp),
                         "--dp", std::to_string(mesh.dp), "--ep", std::to_string(mesh.ep), "--cp",
                         std::to_string(mesh.cp)});
    }
    if (auto base = absl::GetFlag(FLAGS_worker_metrics_port_base)) {  // local worker r: Prometheus on base + r
      a.insert(a.end(), {"--metrics_port", std::to_string(*base + r)});
    }
    per_rank.push_back(std::move(a));
  }
  return per_rank;
}

// A client of the worker at an address, once it accepts connections (UNAVAILABLE after
// `wait_s` seconds: nothing answers there); `spawned`: a worker this coordinator started,
// `pipe_fd`: its call pipe (-1: none).
struct WorkerConnector {
  std::chrono::seconds call_timeout;
  std::string worker_token;
  lorastep::WorkerTls worker_tls;
  bool poll_pipe_answers = false;

  absl::StatusOr<std::unique_ptr<lorastep::WorkerClient>> Connect(const std::string& address, int wait_s,
                                                                  bool spawned = false, int pipe_fd = -1) const {
    using namespace lorastep;
    auto client = std::make_unique<GrpcWorkerClient>(address, call_timeout, worker_token, worker_tls, pipe_fd, spawned);
    client->set_poll_pipe_answers(poll_pipe_answers);
    LORASTEP_RETURN_IF_ERROR(client->WaitReady(wait_s));
    return std::unique_ptr<WorkerClient>(std::move(client));
  }
};

// How the coordinator gets a dead worker back (CoordinatorOptions::restart_worker and
// restart_mesh): a local worker is started again (a mesh: every rank, at a fresh rendezvous);
// with a journal, listed workers belong to someone else's supervisor and are awaited at their
// addresses (a mesh: at every address, then a new generation of communicators). Runs come back
// from their autosaves; without a journal they are lost.
void SetWorkerRestarts(lorastep::LocalWorkers* local, const std::vector<std::string>* listed, bool journal,
                       const WorkerConnector* connector, lorastep::CoordinatorOptions* options) {
  using namespace lorastep;
  const bool mesh = options->mesh.world() > 1;
  if (local != nullptr && !mesh) {
    options->restart_worker = [=](const std::string& address) -> absl::StatusOr<std::unique_ptr<WorkerClient>> {
      LORASTEP_ASSIGN_OR_RETURN(LocalWorker fresh, local->RestartOne(address));
      return connector->Connect(fresh.address, 60, true, fresh.pipe_fd);
    };
  } else if (local != nullptr && journal) {
    options->restart_mesh = [=]() -> absl::StatusOr<std::vector<std::unique_ptr<WorkerClient>>> {
      LORASTEP_ASSIGN_OR_RETURN(std::vector<LocalWorker> fresh, local->RestartAll());
      std::vector<std::unique_ptr<WorkerClient>> clients;
      for (const LocalWorker& w : fresh) {
        LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<WorkerClient> client, connector->Connect(w.address, 60, true, w.pipe_fd));
        clients.push_back(std::move(client));
      }
      return clients;
    };
  } else if (local == nullptr && journal && !listed->empty() && !mesh) {
    options->restart_worker = [=](const std::string& address) -> absl::StatusOr<std::unique_ptr<WorkerClient>> {
      return connector->Connect(address, 2);  // UNAVAILABLE: not back yet
    };
  } else if (local == nullptr && journal && !listed->empty()) {
    options->restart_mesh = [=]() -> absl::StatusOr<std::vector<std::unique_ptr<WorkerClient>>> {
      std::vector<std::unique_ptr<WorkerClient>> clients;
      for (const std::string& address : *listed) {
        LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<WorkerClient> client, connector->Connect(address, 2));
        clients.push_back(std::move(client));
      }
      return clients;
    };
  }
}

// Checked on each call's headers, before its message is read: the Registry needs the cluster
// secret; with API keys the Trainer API and reflection need a key.
std::shared_ptr<lorastep::CallAuthenticator> AuthenticatorFor(const lorastep::SecurityPolicy& policy,
                                                              const std::string& worker_token,
                                                              const lorastep::ApiKeys* api_keys) {
  using namespace lorastep;
  auto authenticator = std::make_shared<CallAuthenticator>();
  if (policy.cluster_needs_secret) {
    authenticator->Require("/lorastep.v1.Registry/", [digest = Sha256Hex(worker_token)](const std::string& auth) {
      return CheckBearerToken(auth, digest);
    });
  } else if (policy.registry_closed) {
    authenticator->Require("/lorastep.v1.Registry/", [](const std::string&) {
      return absl::UnauthenticatedError("this coordinator holds no cluster secret: its Registry admits no worker");
    });
  }
  if (policy.trainer_needs_api_key) {
    auto key_check = [api_keys](const std::string& auth) { return api_keys->Authenticate(auth).status(); };
    authenticator->Require("/lorastep.v1.Trainer/", key_check);
    authenticator->Require("/grpc.reflection.", key_check);
  }
  return authenticator;
}

// The shutdown after the signal: open calls get 3 s, then are cancelled (Shutdown returns once
// every handler has finished, so a step's worker calls are cancelled too, and the worker stops
// at its next micro-batch); autosaves still being written become durable (up to 30 s); then
// the workers stop.
void DrainAndStop(grpc::Server* server, lorastep::Coordinator* core, bool journal, lorastep::LocalWorkers* local) {
  using namespace lorastep;
  const auto grace_end = std::chrono::system_clock::now() + std::chrono::seconds(3);
  std::promise<void> stopped;
  std::future<void> stopped_future = stopped.get_future();
  std::thread stopper([&] {
    server->Shutdown(grace_end);
    stopped.set_value();
  });
  if (stopped_future.wait_until(grace_end) != std::future_status::ready) core->CancelWorkerCalls();
  stopper.join();
  if (journal && !core->WaitForAutosaves(std::chrono::seconds(30))) {
    LORASTEP_LOG(Warning) << "lorastep_coordinator: background autosaves still unfinished after 30 s; runs resume "
                             "from the autosave before";
  }
  core->CancelWorkerCalls();  // the steps still running have no client left
  core->StopWorkerUpkeep();   // the workers' exit below is no death to restart
  if (local != nullptr) local->StopAll();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ServerProcess process(argc, argv, "lorastep_coordinator",
                        "lorastep_coordinator [--model DIR | --workers A,B | --wait_for_workers] [flags]: the "
                        "public Trainer API over local or registered workers. See --help for the flags.");
  auto fail = [&process](const absl::Status& s) { return process.Fail(s, 1); };
  // Every flag is read and checked, and every security decision made, before a worker starts.
  auto worker_token = ClusterSecretForWorkers();
  if (!worker_token.ok()) return fail(worker_token.status());
  auto settings = ServiceSettingsFromFlags();
  if (!settings.ok()) return fail(settings.status());
  if (!process.metrics_status().ok()) return fail(process.metrics_status());
  // --api_keys_file: every Trainer call needs a key, and callers see only their own runs.
  // Without it the coordinator listens on loopback only, unless told otherwise.
  std::optional<ApiKeys> api_keys;
  if (!absl::GetFlag(FLAGS_api_keys_file).empty()) {
    auto loaded = ApiKeys::Load(absl::GetFlag(FLAGS_api_keys_file));
    if (!loaded.ok()) return fail(loaded.status());
    api_keys = std::move(loaded).value();
  }
  auto policy = SecurityFromFlags(*worker_token, api_keys.has_value());
  if (!policy.ok()) return fail(policy.status());
  if (!policy->warning.empty()) LORASTEP_LOG(Warning) << "lorastep_coordinator: " << policy->warning;
  auto options = CoordinatorOptionsFromFlags();
  if (!options.ok()) return fail(options.status());
  options->metrics = process.metrics();
  RunStorage storage;
  if (absl::Status s = OpenRunStorage(&*options, &storage); !s.ok()) return fail(s);
  auto worker_tls = WorkerTlsFromFlags();
  if (!worker_tls.ok()) return fail(worker_tls.status());
  // --tls_cert_file/--tls_key_file: the Trainer API over TLS (workers stay on plaintext
  // loopback or a private network, authenticated by the worker token).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!absl::GetFlag(FLAGS_tls_cert_file).empty() || !absl::GetFlag(FLAGS_tls_key_file).empty()) {
    auto tls = TlsServerCredentials(absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file));
    if (!tls.ok()) return fail(tls.status());
    credentials = *tls;
  }
  const bool listed = !absl::GetFlag(FLAGS_workers).empty(), registered = absl::GetFlag(FLAGS_wait_for_workers);
  if (!listed && !registered && absl::GetFlag(FLAGS_model).empty()) {
    return process.Fail(absl::InvalidArgumentError("--model (for the local worker) or --workers is required"));
  }
  const WorkerConnector connector{std::chrono::seconds(absl::GetFlag(FLAGS_worker_call_timeout_s)), *worker_token,
                                  *worker_tls, absl::GetFlag(FLAGS_worker_pipe_poll).value_or(OnCuda())};
  // The workers: listed, registered later, in this process, or started here (one per rank).
  std::vector<std::string> addresses;
  if (listed) addresses = absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty());
  std::vector<LocalWorker> spawned;
  std::unique_ptr<LocalWorkers> local;
  std::unique_ptr<WorkerClient> in_process;
  std::optional<StatePruner> in_process_pruner;  // --state_ttl_hours, as a worker process would run it
  if (absl::GetFlag(FLAGS_in_process_worker)) {
    auto created = StartLocalWorkerInProcess(options->mesh.world(), storage.state_dir);
    if (!created.ok()) return fail(created.status());
    in_process = std::move(created).value();
    if (const auto ttl = absl::GetFlag(FLAGS_state_ttl_hours)) {
      if (!(*ttl > 0) || storage.state_dir.empty()) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "state_ttl_hours: '", *ttl, "' must be a positive number of hours, with a state store (not --allow_plain_paths)")));
      }
      in_process_pruner.emplace(storage.state_dir, static_cast<int64_t>(*ttl * 3600));
    }
  } else if (!listed && !registered) {
    auto per_rank = LocalWorkerFlags(options->mesh, storage.state_dir, *worker_tls);
    if (!per_rank.ok()) return fail(per_rank.status());
    const std::string binary =
        !absl::GetFlag(FLAGS_worker_binary).empty() ? absl::GetFlag(FLAGS_worker_binary) : FindWorkerBinary(argv[0]);
    auto started = LocalWorkers::Start(binary, *std::move(per_rank), absl::GetFlag(FLAGS_worker_start_timeout_s),
                                       absl::GetFlag(FLAGS_worker_pipe));
    if (!started.ok()) return fail(started.status());
    local = *std::move(started);
    spawned = local->TakeStarted();
  }
  SetWorkerRestarts(local.get(), &addresses, storage.journal.has_value(), &connector, &*options);
  Coordinator core{*options};
  const size_t num_workers = addresses.size() + spawned.size() + (in_process != nullptr ? 1 : 0);
  if (in_process != nullptr) {
    if (auto s = core.AddWorker(std::move(in_process)); !s.ok()) return fail(s);
  }
  for (const LocalWorker& w : spawned) {
    auto client = connector.Connect(w.address, 60, /*spawned=*/true, w.pipe_fd);
    if (!client.ok()) return fail(client.status());
    if (auto s = core.AddWorker(std::move(client).value()); !s.ok()) return fail(s);
  }
  for (const std::string& address : addresses) {
    auto client = connector.Connect(address, 60);
    if (!client.ok()) return fail(client.status());
    if (auto s = core.AddWorker(std::move(client).value()); !s.ok()) return fail(s);
  }
  // Registered workers are not here yet: their runs come back as they register (Reattach,
  // RejoinMesh).
  if (!registered) {
    auto restored = core.RestoreRuns();
    if (!restored.ok()) return fail(restored.status());
    if (storage.journal) {
      LORASTEP_LOG(Info) << "lorastep_coordinator: " << *restored << " run(s) restored from " << storage.journal->dir();
    }
  }
  // One thread per run with a call in flight, up to 64: the worker co-schedules only the
  // calls of different runs that reach it together. An in-process worker's calls run on these
  // threads; LibTorch sets up CUDA state per thread (cuBLAS handles and workspaces) on its
  // first call, and the executor hands work to the most recently idle thread, so a steady
  // caller keeps one warm thread.
  CoordinatorService service(&core, /*executors=*/64, process.metrics(), api_keys ? &*api_keys : nullptr,
                             std::chrono::microseconds(settings->executor_spin_us));
  service.SetAdmissionLimits(settings->admission);
  service.SetWatchBacklog(static_cast<size_t>(std::max<int64_t>(absl::GetFlag(FLAGS_max_watch_backlog), 1)));
  service.SetPollerWarmth(std::chrono::microseconds(settings->poller_warm_us));
  service.SetUploadLimit(settings->max_upload_bytes);
  RegistryService registry(&core, *worker_token, *worker_tls);
  CallObservers observers{process.metrics(), VerbosityFlag(), "coordinator", -1};
  observers.raw_methods = CoordinatorService::RawMethods();
  observers.services = {"lorastep.v1.Trainer", "lorastep.v1.Registry"};
  int port = 0;
  auto server = StartGrpcServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_port), {&service, &registry}, &port,
                                settings->max_request_bytes, observers, credentials,
                                AuthenticatorFor(*policy, *worker_token, api_keys ? &*api_keys : nullptr));
  if (!server.ok()) return fail(server.status());
  auto tinker = StartTinkerFromFlags(&core, api_keys ? &*api_keys : nullptr, service.admission(),
                                     absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_tls_cert_file),
                                     absl::GetFlag(FLAGS_tls_key_file), storage.state_dir, observers);
  if (!tinker.ok()) return fail(tinker.status());
  // grpc.health.v1 follows the workers: NOT_SERVING while none is up (a mesh: any rank down).
  core.OnServingChange([srv = server->get()](bool serving) { srv->GetHealthCheckService()->SetServingStatus(serving); });
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    if (auto s = WritePortFile(absl::GetFlag(FLAGS_port_file), port); !s.ok()) return fail(s);
  }
  if (num_workers == 0) {
    LORASTEP_LOG(Info) << "lorastep_coordinator: port " << port << ", waiting for workers to register";
  } else {
    LORASTEP_LOG(Info) << "lorastep_coordinator: serving " << core.model_path() << " on port " << port << " with "
                       << num_workers << " worker(s)" << (absl::GetFlag(FLAGS_in_process_worker) ? " (in process)" : "");
  }
  // 3 s for open calls, up to 30 s for autosaves, 10 s for each worker's SIGTERM: past this
  // the process exits anyway.
  process.ServeUntilShutdownSignal(std::chrono::seconds(kShutdownDeadlineSeconds));
  tinker->server.reset();  // no new Tinker calls; those queued fail fast once the workers stop
  DrainAndStop(server->get(), &core, storage.journal.has_value(), local.get());
  tinker->front.reset();
  return 0;
}
