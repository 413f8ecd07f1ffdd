#include "server/coordinator.h"

#include <google/protobuf/io/coded_stream.h>
#include <malloc.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <cctype>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <future>
#include <limits>
#include <mutex>
#include <set>
#include <random>
#include <thread>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "lib/log.h"
#include "absl/strings/str_join.h"
#include "lib/io/state_store.h"
#include "lib/training/adamw_params.h"
#include "lib/model/lora_config.h"
#include "lib/status_macros.h"
#include "lib/training/metrics.h"
#include "rpc/proto_convert.h"
#include "rpc/serial_executor.h"
#include "rpc/step_metrics.h"

namespace lorastep {

struct Coordinator::RunState : std::enable_shared_from_this<Coordinator::RunState> {
  std::mutex mu;  // serializes calls on this run; guards everything below but the autosave fields
  // Readers (GetRun, ListRuns, GetStepMetrics) take only this, so they never wait for a
  // training step: it guards `run` and `history`, which writers (holding `mu`) change only
  // while holding it too.
  mutable std::mutex view_mu;
  v1::Run run;
  std::vector<WorkerClient*> ranks;  // rank -> worker (one worker when not on a mesh)
  // Autosaves (with a journal), guarded by autosave_mu: the checkpoint name of the last
  // durable one, the number of the next, whether one is being written in the background (one
  // at a time per run). The confirmation holds autosave_mu while it journals an autosave as
  // durable; a restore holds it while it reads the journal.
  std::mutex autosave_mu;
  std::condition_variable autosave_cv;  // a background autosave ended
  std::string durable_autosave;
  int64_t next_autosave = 1;
  bool autosave_in_flight = false;
  // The last autosave: when it ended and how long it took, in the background from its
  // snapshot until it was durable, written or not (< 0: none yet in this process).
  std::chrono::steady_clock::time_point last_autosave_end;
  double last_autosave_s = -1;
  // Guarded by `mu`: a step was committed after the last autosave taken (durable or not),
  // and when a call last changed the run's state. An idle run with such a step is saved.
  bool step_since_autosave = false;
  std::chrono::steady_clock::time_point last_change = std::chrono::steady_clock::now();
  bool retired = false;  // restored anew or deleted: a late confirmation changes nothing
  struct Recorded {
    std::string method;
    std::string response;  // serialized
    std::string fingerprint;  // of the request: a reused request_id must carry the same payload
    bool evicted = false;     // the response was dropped to bound memory; the id stays known
  };
  size_t recorded_bytes = 0;  // sum of the kept responses' sizes
  std::map<std::string, Recorded> recorded;
  std::deque<std::string> recorded_order;  // oldest first, for eviction
  // The fingerprint of the mutating call in progress (set by Replay, stored by Record; both
  // under `mu`, which the call holds throughout).
  std::string current_fingerprint;
  std::deque<v1::StepRecord> history;
  int64_t next_step = 0;
  // Set when the run was restored from its autosave (restart): appended to a sequence-id
  // error, so a client that sent calls past the autosave learns where the run resumed.
  std::string restored_note;
  std::mutex watch_mu;  // guards watchers; held while calling them
  std::map<int64_t, Watcher> watchers;
  int64_t next_watch_id = 1;
};

namespace {

// client_metrics of a step request: bounded, named plainly, finite (docs/API.md).
absl::Status ValidateClientMetrics(const google::protobuf::Map<std::string, double>& m) {
  if (m.size() > 32) return absl::InvalidArgumentError(absl::StrCat("client_metrics: ", m.size(), " entries, at most 32"));
  for (const auto& [name, value] : m) {
    const bool plain = !name.empty() && name.size() <= 64 &&
                       std::all_of(name.begin(), name.end(), [](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("_.:/-", c) != nullptr;
                       });
    if (!plain) {
      return absl::InvalidArgumentError(absl::StrCat("client_metrics: name '", absl::CHexEscape(name.substr(0, 80)),
                                                     "' must be 1-64 characters of [A-Za-z0-9_.:/-]"));
    }
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat("client_metrics[", name, "]: ", value, " is not finite"));
    }
  }
  return absl::OkStatus();
}

void AddClientMetrics(const google::protobuf::Map<std::string, double>& m, v1::StepResponse* resp) {
  for (const auto& [name, value] : m) (*resp->mutable_metrics())["client:" + name] = value;
}

// A mesh rank's failure that only reflects a peer's: ABORTED by the outcome vote, a
// collective that timed out or broke waiting for another rank.
bool IsPeerFailure(const absl::Status& s) {
  return absl::IsAborted(s) || absl::IsDeadlineExceeded(s) ||
         (absl::IsUnavailable(s) && s.message().find(" group ") != absl::string_view::npos);
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

v1::WorkerPathRequest PathRequest(const std::string& run_id, const std::string& path) {
  v1::WorkerPathRequest req;
  req.set_run_id(run_id);
  req.set_path(path);
  return req;
}

// SHA-256 of the request's deterministic serialization (map fields in key order).
std::string RequestFingerprint(const google::protobuf::Message& request) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&out);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), len);
}

// A request's fingerprint computed on another thread while the workers run: serializing and
// hashing a 450 KB batch took 1.1-1.8 ms of every TrainStep on the H200's coordinator. The
// task reads the request, so it is joined (by ~FingerprintTask) before it leaves the scope
// that holds the request. The hashing runs on long-lived threads, keyed by run so one run's
// hashes do not queue behind another's: starting a thread per call (std::async) cost about
// 0.1 ms of the step on the H200 host.
KeyedExecutor& FingerprintThreads() {
  static KeyedExecutor* threads = new KeyedExecutor(2);  // never joined: lives as long as the process
  return *threads;
}

class FingerprintTask {
 public:
  FingerprintTask(const std::string& run_id, const google::protobuf::Message& request) {
    auto promise = std::make_shared<std::promise<std::string>>();
    done_ = promise->get_future();
    FingerprintThreads().Submit(run_id, [promise, &request] { promise->set_value(RequestFingerprint(request)); });
  }
  // An early return must not leave the hash reading a request that is gone.
  ~FingerprintTask() {
    if (done_.valid()) done_.wait();
  }
  std::string Get() { return done_.get(); }

 private:
  std::future<std::string> done_;
};

// Where a journaled run's worker state is saved after its steps: autosave-<n>, a fresh name
// each time, so a background write never replaces the autosave a restart would need.
// ("autosave" alone: journals written before the names.) Reserved for the journal.
std::string AutosaveRef(const std::string& run_id, const std::string& name) {
  return absl::StrCat(kStateRefScheme, run_id, "/", name);
}
// The <name> of a lorastep://<run_id>/<name> reference ("" for any other path).
std::string OwnRefName(const std::string& run_id, absl::string_view path) {
  if (!absl::ConsumePrefix(&path, kStateRefScheme) || !absl::ConsumePrefix(&path, run_id) ||
      !absl::ConsumePrefix(&path, "/")) {
    return "";
  }
  return std::string(path);
}
bool IsAutosaveName(absl::string_view name) {
  if (name == "autosave") return true;
  if (!absl::ConsumePrefix(&name, "autosave-") || name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}
// The number of autosave-<n> (0 for "autosave" or another name).
int64_t AutosaveNumber(absl::string_view name) {
  int64_t n = 0;
  if (!IsAutosaveName(name) || !absl::ConsumePrefix(&name, "autosave-") || !absl::SimpleAtoi(name, &n)) return 0;
  return n;
}

// A Forward(Backward) response's size, from above: per datum a float per target (packed)
// plus framing, and the metrics map.
absl::Status CheckResponseFits(const std::vector<Datum>& datums, int64_t max_bytes) {
  if (max_bytes == 0) return absl::OkStatus();
  if (max_bytes < 0) return absl::InvalidArgumentError("max_response_bytes: must be >= 0");
  int64_t bytes = 16 << 10, tokens = 0;
  for (const auto& d : datums) {
    tokens += static_cast<int64_t>(d.target_tokens.size());
    bytes += 4 * static_cast<int64_t>(d.target_tokens.size()) + 16;
  }
  if (bytes <= max_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "max_response_bytes: the response would take up to ", bytes, " bytes (log-probs of ", tokens,
      " targets), over the caller's limit of ", max_bytes, "; split the batch or raise the limit (nothing was run)"));
}

// A mesh generation names the store keys its communicators rendezvous under, so it must be
// one no rank has used: random rather than counted, so that a restarted coordinator (which
// forgot its count) never sends ranks that outlived it back to keys their earlier
// generations left behind. Workers only compare it for equality.
int64_t NewMeshGeneration(int64_t current) {
  static std::mutex mu;
  static std::mt19937 rng(std::random_device{}());
  std::lock_guard<std::mutex> lock(mu);
  int64_t next = current;
  while (next == current) next = std::uniform_int_distribution<int32_t>(0, std::numeric_limits<int32_t>::max())(rng);
  return next;
}

absl::Status RequireRequestId(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: required for this call");
  return absl::OkStatus();
}

}  // namespace

Coordinator::~Coordinator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  restart_cv_.notify_all();
  if (restarter_.joinable()) restarter_.join();
  if (idle_saver_.joinable()) idle_saver_.join();
  if (health_watch_.joinable()) health_watch_.join();
}

void Coordinator::RestartLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    restart_cv_.wait(lock, [&] {
      return stopping_ || mesh_rejoined_ || !restart_queue_.empty() || !reattach_queue_.empty();
    });
    if (stopping_) return;
    if (mesh_rejoined_) {
      mesh_rejoined_ = false;
      lock.unlock();
      RejoinMesh();
      lock.lock();
      continue;
    }
    if (!reattach_queue_.empty()) {
      WorkerClient* joined = reattach_queue_.front();
      reattach_queue_.pop_front();
      lock.unlock();
      Reattach(joined);
      lock.lock();
      continue;
    }
    WorkerClient* dead = restart_queue_.front();
    restart_queue_.pop_front();
    if (on_mesh()) restart_queue_.clear();  // one restart brings every rank back
    // A worker marked down while an earlier restart was replacing it (a call or health check
    // reached the old process as it was stopped) is gone already: restarting for it would
    // stop the fresh workers, and under load every restart queued the next one.
    const bool stale = dead != nullptr && std::none_of(workers_.begin(), workers_.end(),
                                                         [&](const auto& w) { return w.get() == dead; });
    if (stale) continue;
    lock.unlock();
    if (on_mesh()) {
      RestartMesh();
    } else {
      RestartWorker(dead);
    }
    lock.lock();
  }
}

Coordinator::Coordinator(CoordinatorOptions options) : options_(options), mesh_generation_(NewMeshGeneration(-1)) {
  auto layout = ParallelLayout::Create(options_.mesh, options_.mesh.world());
  if (layout.ok()) layout_ = *layout;  // sizes were validated by the caller (main)
  if (options_.metrics != nullptr) {
    DeclareStepMetrics(options_.metrics);
    options_.metrics->Declare("lorastep_runs", PrometheusRegistry::Type::kGauge, "runs that exist on this coordinator");
    options_.metrics->Declare("lorastep_autosave_failures_total", PrometheusRegistry::Type::kCounter,
                              "background autosaves that were not written (a restart resumes from the one before)");
  }
  // With a journal the thread restarts dead workers and re-attaches registered ones
  // (AddWorker queues them; a mesh once every rank is up). Without a journal it still starts a dead local
  // worker again: its runs' state is lost, but the service comes back for new runs.
  const bool restarts = on_mesh() ? static_cast<bool>(options_.restart_mesh) : static_cast<bool>(options_.restart_worker);
  if (restarts || options_.journal != nullptr) {
    restarter_ = std::thread([this] { RestartLoop(); });
  }
  if (options_.journal != nullptr && options_.autosave_when_idle.count() > 0) {
    idle_saver_ = std::thread([this] { IdleAutosaveLoop(); });
  }
  if (options_.worker_health_interval.count() > 0) health_watch_ = std::thread([this] { HealthWatchLoop(); });
}

void Coordinator::HealthWatchLoop() {
  std::map<const WorkerClient*, int> unanswered;  // consecutive UNAVAILABLE pings
  const auto timeout = std::chrono::seconds(5);
  std::unique_lock<std::mutex> lock(mu_);
  while (!restart_cv_.wait_for(lock, options_.worker_health_interval, [&] { return stopping_; })) {
    std::vector<WorkerClient*> up;
    for (const auto& w : workers_) {
      if (w != nullptr && !down_.count(w.get())) up.push_back(w.get());
    }
    lock.unlock();
    std::map<const WorkerClient*, int> still;
    for (WorkerClient* w : up) {
      // Only a process that is gone (the transport fails) counts; a busy or stopped one that
      // does not answer in time is left to the calls' deadlines.
      absl::Status alive = w->Ping(timeout);
      if (!absl::IsUnavailable(alive)) continue;
      if ((still[w] = unanswered[w] + 1) >= 2) MarkDown(w, alive);
    }
    unanswered = std::move(still);
    lock.lock();
  }
}


absl::Status Coordinator::AddWorker(std::unique_ptr<WorkerClient> worker) {
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerInfo info, worker->Info());
  std::lock_guard<std::mutex> lock(mu_);
  if (on_mesh()) {
    const ParallelSizes& m = options_.mesh;
    if (info.world_size() != m.world() || info.tp() != m.tp || info.pp() != m.pp || info.dp() != m.dp) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", worker->address(), " is rank ", info.rank(), " of a tp", info.tp(), " x pp",
          info.pp(), " x dp", info.dp(), " mesh, not of ", layout_.ToString()));
    }
    if (workers_.size() != static_cast<size_t>(m.world())) workers_.resize(m.world());
    const auto& held = workers_[info.rank()];
    if (held != nullptr && held->address() == worker->address() && !down_.count(held.get())) {
      return absl::OkStatus();  // registered again (--register_every_s): kept as it is
    }
    if (workers_[info.rank()] != nullptr && !down_.count(workers_[info.rank()].get())) {
      return absl::AlreadyExistsError(absl::StrCat("worker ", worker->address(), ": rank ",
                                                   info.rank(), " is already registered"));
    }
  }
  // A journaled mesh restores its runs from autosaves that rank 0 writes and every rank
  // loads: the ranks must share one state store.
  const bool shares_store = on_mesh() && options_.journal != nullptr;
  if (shares_store && info.state_store_id().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "journal_dir: rank ", info.rank(), " at ", worker->address(),
        " has no state store; the ranks of a journaled mesh need one --state_dir they share"));
  }
  if (RegisteredWorkers() == 0) {
    model_path_ = info.model_path();
    vocab_size_ = info.vocab_size();
    mesh_store_id_ = info.state_store_id();
  } else if (info.model_path() != model_path_ || info.vocab_size() != vocab_size_) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker->address(), " serves ",
                                                      info.model_path(), ", not ", model_path_));
  } else if (shares_store && info.state_store_id() != mesh_store_id_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "journal_dir: rank ", info.rank(), " at ", worker->address(), " has a state store of its own (id ",
        info.state_store_id(), ", the other ranks' ", mesh_store_id_,
        "); the ranks of a journaled mesh need one --state_dir they share (rank 0 writes the autosaves "
        "every rank loads)"));
  }
  if (on_mesh()) {
    auto& slot = workers_[info.rank()];
    // A dead rank's client stays (down, alive): runs placed on it fail as down until restored.
    if (slot != nullptr) {
      replaced_.push_back(std::move(slot));
      mesh_regenerate_ = true;
    }
    slot = std::move(worker);
    rejoining_ranks_.erase(info.rank());
    if (rendezvous_.empty() && info.rank() == 0) rendezvous_ = info.rendezvous();  // a restarted coordinator
    if (options_.mesh_by_registration && restarter_.joinable() && Serving()) {
      mesh_rejoined_ = true;
      restart_cv_.notify_all();
    }
  } else {
    // Registered workers announce themselves again and again (--register_every_s): the
    // process that is up at this address already is kept as it is. Another process there
    // (restarted before any call found the old one dead) replaces it.
    for (const auto& w : workers_) {
      if (w->address() != worker->address() || down_.count(w.get())) continue;
      auto known = instances_.find(w.get());
      if (known == instances_.end() || known->second == info.instance_id()) return absl::OkStatus();
      LORASTEP_LOG(Warning) << "lorastep_coordinator: worker " << w->address()
                            << " is a new process (the one known there is gone); it replaces it";
      down_.insert(w.get());
      break;
    }
    auto same = std::find_if(workers_.begin(), workers_.end(), [&](const auto& w) {
      return w->address() == worker->address() && down_.count(w.get());
    });
    WorkerClient* joined = worker.get();
    instances_[joined] = info.instance_id();
    if (same != workers_.end()) {  // a restarted worker takes its dead predecessor's place
      // The old client stays down (and alive): runs made there keep failing as down rather
      // than reaching the new process, which never had them (until Reattach restores them).
      replaced_.push_back(std::move(*same));
      *same = std::move(worker);
    } else {
      workers_.push_back(std::move(worker));
    }
    // With a journal, runs that belong at this address come back onto it; a restarted local
    // worker's runs are restored by RestartWorker instead.
    if (restarter_.joinable() && !RestartsDeadWorkers()) {
      reattach_queue_.push_back(joined);
      restart_cv_.notify_all();
    }
  }
  PublishHealth();
  return absl::OkStatus();
}

void Coordinator::OnServingChange(std::function<void(bool)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_serving_ = std::move(callback);
  PublishHealth();
}

bool Coordinator::Serving() const {
  const size_t up = std::count_if(workers_.begin(), workers_.end(),
                                  [&](const auto& w) { return w != nullptr && !down_.count(w.get()); });
  return on_mesh() ? up == static_cast<size_t>(options_.mesh.world()) : up > 0;
}

void Coordinator::PublishHealth() {
  if (on_serving_) on_serving_(Serving());
}

void Coordinator::MarkDown(WorkerClient* worker, const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!down_.insert(worker).second) return;
  LORASTEP_LOG(Warning) << "lorastep_coordinator: worker " << worker->address() << " is down (" << why.message()
                        << "); new runs skip it";
  PublishHealth();
  if (RestartsDeadWorkers()) {
    restart_queue_.push_back(worker);
    restart_cv_.notify_all();
  }
}

bool Coordinator::RestartsDeadWorkers() const {
  return restarter_.joinable() && (on_mesh() ? static_cast<bool>(options_.restart_mesh)
                                             : static_cast<bool>(options_.restart_worker));
}

std::string Coordinator::WhatHappensToDownRuns() const {
  if (RestartsDeadWorkers() && options_.journal == nullptr) {
    return "the worker is started again, but without a journal (a coordinator on --port 0 without --state_dir, "
           "or --nojournal) the run's state there is lost; DeleteRun it, or CreateRun with init_from a checkpoint";
  }
  if (RestartsDeadWorkers()) {
    return "it is being restarted and the run restored from its autosave; retry";
  }
  if (restarter_.joinable() && on_mesh()) {
    return "the run comes back from its autosave once a worker has registered in the dead rank's place; retry then";
  }
  if (restarter_.joinable()) {
    return "the run comes back from its autosave when a worker registers at that address again; retry then";
  }
  return "the run's state there is lost; LoadState a checkpoint into a new run (CreateRun with init_from)";
}

void Coordinator::Reattach(WorkerClient* joined) {
  const std::string address = joined->address();
  // The runs of a dead predecessor at this address, then journaled runs not restored yet
  // (a restarted coordinator has no worker until one registers).
  std::vector<std::shared_ptr<RunState>> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, run] : runs_) {
      if (run->ranks.size() == 1 && run->ranks[0] != joined && down_.count(run->ranks[0]) &&
          run->ranks[0]->address() == address) {
        orphans.push_back(run);
      }
    }
  }
  RestoreOrphans(orphans, joined);
  RestoreJournaledRuns(joined);
}

void Coordinator::RestoreJournaledRuns(WorkerClient* onto) {
  const std::string where = onto != nullptr ? onto->address() : layout_.ToString();
  std::vector<absl::Status> skipped;
  auto journaled = options_.journal->Recover(&skipped);
  if (!journaled.ok()) {
    LORASTEP_LOG(Error) << "journal: " << journaled.status();
    return;
  }
  for (const JournaledRun& j : *journaled) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (runs_.count(j.created.run().run_id())) continue;
    }
    // A run whose autosave lives in another worker's state store fails here and waits for
    // that worker to register.
    if (absl::Status s = RestoreRun(j, onto); !s.ok()) {
      LORASTEP_LOG(Warning) << "run " << j.created.run().run_id() << " not restored onto " << where << ": " << s;
    } else {
      LORASTEP_LOG(Info) << "run " << j.run.run_id() << " restored onto " << where << " at learner_version "
                         << j.run.learner_version();
    }
  }
}

void Coordinator::RejoinMesh() {
  // (A replaced rank has already set mesh_regenerate_: the restores' calls form a new
  // generation.)
  std::vector<std::shared_ptr<RunState>> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, run] : runs_) {
      if (std::any_of(run->ranks.begin(), run->ranks.end(), [&](WorkerClient* w) { return down_.count(w) > 0; })) {
        orphans.push_back(run);
      }
    }
  }
  LORASTEP_LOG(Info) << "lorastep_coordinator: mesh " << layout_.ToString() << " is whole; " << orphans.size()
                     << " run(s) with a replaced rank to restore";
  RestoreOrphans(orphans);
  RestoreJournaledRuns(nullptr);
}

void Coordinator::RestartWorker(WorkerClient* dead) {
  const std::string address = dead->address();
  auto try_again = [&] {  // nothing (alive) answers there yet: back into the queue, after a pause
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::lock_guard<std::mutex> lock(mu_);
    restart_queue_.push_back(dead);
  };
  auto fresh = options_.restart_worker(address);
  if (!fresh.ok()) {
    if (absl::IsUnavailable(fresh.status())) return try_again();  // a listed worker not back yet
    LORASTEP_LOG(Error) << "lorastep_coordinator: restarting the worker at " << address << ": " << fresh.status();
    return;
  }
  const std::string replacement = (*fresh)->address();
  WorkerClient* onto = fresh->get();
  if (absl::Status added = AddWorker(std::move(fresh).value()); !added.ok()) {
    LORASTEP_LOG(Error) << "lorastep_coordinator: the restarted worker " << replacement << ": " << added;
    // e.g. the killed process's socket still accepted the connection
    if (absl::IsUnavailable(added)) try_again();
    return;
  }
  LORASTEP_LOG(Info) << "lorastep_coordinator: worker " << address << " restarted as " << replacement;
  std::vector<std::shared_ptr<RunState>> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, run] : runs_) {
      if (run->ranks.size() == 1 && run->ranks[0] == dead) orphans.push_back(run);
    }
  }
  RestoreOrphans(orphans, onto);
}

void Coordinator::RestartMesh() {
  auto try_again = [&] {  // a listed rank not back yet: ask again, after a pause
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::lock_guard<std::mutex> lock(mu_);
    restart_queue_.push_back(nullptr);
    restart_cv_.notify_all();
  };
  auto fresh = options_.restart_mesh();
  if (!fresh.ok()) {
    if (absl::IsUnavailable(fresh.status())) return try_again();  // quietly: it may take a while
    LORASTEP_LOG(Error) << "lorastep_coordinator: restarting the mesh: " << fresh.status();
    return;
  }
  std::vector<std::shared_ptr<RunState>> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Ranks that lived on (a listed mesh) may have started forming the generation the
    // failure moved to, and left their sockets under its store keys: the next call moves
    // every rank to a generation no one has used.
    mesh_regenerate_ = true;
    // The old clients stay (down, alive): calls of runs placed on them fail as down until
    // the run is restored onto the new ranks.
    for (auto& w : workers_) {
      if (w == nullptr) continue;
      down_.insert(w.get());
      replaced_.push_back(std::move(w));
    }
    workers_.clear();
    for (const auto& [id, run] : runs_) orphans.push_back(run);  // every run spans every rank
  }
  for (auto& worker : *fresh) {
    const std::string address = worker->address();
    if (absl::Status added = AddWorker(std::move(worker)); !added.ok()) {
      LORASTEP_LOG(Error) << "lorastep_coordinator: the restarted rank at " << address << ": " << added;
      // e.g. the dead process's connection was still open (gRPC shares it between channels
      // to one address): the next try replaces what this one added.
      if (absl::IsUnavailable(added)) try_again();
      return;
    }
  }
  LORASTEP_LOG(Info) << "lorastep_coordinator: mesh " << layout_.ToString() << " restarted";
  RestoreOrphans(orphans);
}

void Coordinator::RestoreOrphans(const std::vector<std::shared_ptr<RunState>>& orphans, WorkerClient* onto) {
  if (options_.journal == nullptr) {  // nothing to restore from: the runs stay on the dead worker
    for (const auto& old : orphans) {
      LORASTEP_LOG(Warning) << "run " << old->run.run_id() << " is lost with its worker (no journal)";
    }
    return;
  }
  for (const auto& old : orphans) {
    std::lock_guard<std::mutex> run_lock(old->mu);  // after the call that found the worker dead
    // The journal is cut back to the last durable autosave by the restore below (Settle): a
    // confirmation of the old run's background autosave arriving later must not record (or
    // delete) anything.
    std::lock_guard<std::mutex> autosave_lock(old->autosave_mu);
    old->retired = true;
    const std::string run_id = old->run.run_id();
    auto journaled = options_.journal->RecoverRun(run_id);
    absl::Status restored = journaled.status();
    if (restored.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (runs_.count(run_id) == 0 || runs_.at(run_id) != old) continue;  // deleted meanwhile
        runs_.erase(run_id);
      }
      restored = RestoreRun(*journaled, onto);
      if (!restored.ok()) {  // keep the old (down) run visible rather than lose it
        std::lock_guard<std::mutex> lock(mu_);
        runs_.emplace(run_id, old);
      }
    }
    if (!restored.ok()) {
      LORASTEP_LOG(Error) << "run " << run_id << " was not restored after its worker died: " << restored;
    } else {
      LORASTEP_LOG(Info) << "run " << run_id << " restored after its worker died, at learner_version "
                         << journaled->run.learner_version();
    }
  }
}

absl::StatusOr<MeshAssignment> Coordinator::AssignRank(const std::string& host) {
  if (host.empty()) return absl::InvalidArgumentError("host: required");
  if (!on_mesh()) {
    return absl::FailedPreconditionError("coordinator: runs no mesh (--tp/--pp/--dp all 1); register as is");
  }
  // Ranks in the order workers ask (skipping ranks that registered again with a restarted
  // coordinator), then the ranks of dead workers, each once until its new worker registers.
  const int world = options_.mesh.world();
  auto registered = [&](int r) { return static_cast<int>(workers_.size()) > r && workers_[r] != nullptr; };
  auto pick = [&]() -> int {  // under mu_; -1: every rank is taken
    while (next_join_rank_ < world && registered(next_join_rank_)) ++next_join_rank_;
    if (next_join_rank_ < world) return next_join_rank_++;
    for (int r = 0; r < world; ++r) {
      if (registered(r) && down_.count(workers_[r].get()) && !rejoining_ranks_.count(r)) {
        rejoining_ranks_.insert(r);
        LORASTEP_LOG(Info) << "lorastep_coordinator: rank " << r << " (down) handed to a worker on " << host;
        return r;
      }
    }
    return -1;
  };
  std::vector<WorkerClient*> up;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (int rank = pick(); rank >= 0) return AssignmentOf(rank, host);
    for (int r = 0; r < world; ++r) {
      if (registered(r) && !down_.count(workers_[r].get())) up.push_back(workers_[r].get());
    }
  }
  // Every rank is taken, but the one asking may be the replacement of a rank that died
  // without any call noticing: a rank whose process is gone is marked down and handed out.
  for (WorkerClient* w : up) {
    if (absl::Status alive = w->Ping(std::chrono::seconds(5)); absl::IsUnavailable(alive)) MarkDown(w, alive);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (int rank = pick(); rank >= 0) return AssignmentOf(rank, host);
  return absl::FailedPreconditionError(absl::StrCat("coordinator: all ", world, " ranks of ", layout_.ToString(),
                                                    " are taken (and answering)"));
}

MeshAssignment Coordinator::AssignmentOf(int rank, const std::string& host) {
  MeshAssignment a;
  a.rank = rank;
  a.sizes = options_.mesh;
  if (a.rank == 0) rendezvous_ = absl::StrCat(host, ":", options_.rendezvous_port);
  a.rendezvous = rendezvous_;
  return a;
}

size_t Coordinator::num_workers() {
  std::lock_guard<std::mutex> lock(mu_);
  return RegisteredWorkers();
}

std::string Coordinator::model_path() {
  std::lock_guard<std::mutex> lock(mu_);
  return model_path_;
}

int64_t Coordinator::vocab_size() {
  std::lock_guard<std::mutex> lock(mu_);
  return vocab_size_;
}

absl::StatusOr<std::shared_ptr<Coordinator::RunState>> Coordinator::FindRun(
    const std::string& run_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  return it->second;
}

absl::Status Coordinator::CheckAccess(const std::string& run_id, const Caller& caller) {
  if (caller.admin) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  // Another owner's run is reported exactly like a missing one: ids do not leak.
  if (it == runs_.end() || it->second->run.owner() != caller.owner) {
    return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Run> Coordinator::CreateRun(const v1::CreateRunRequest& req, const std::string& owner,
                                                const std::string& id_prefix) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(req.request_id()));
  LORASTEP_ASSIGN_OR_RETURN(LoraConfig lora, LoraConfigFromProto(req.lora()));
  LORASTEP_RETURN_IF_ERROR(ValidateLoraConfig(lora));
  std::unique_lock<std::mutex> lock(mu_);
  const size_t registered = RegisteredWorkers();
  if (on_mesh() && !Serving()) {  // a rank of the current mesh is down (replaced ones stay in down_)
    return absl::UnavailableError("coordinator: a rank of the mesh is down; restart the mesh");
  }
  if (registered == 0 || (on_mesh() && registered < static_cast<size_t>(options_.mesh.world()))) {
    return absl::UnavailableError(absl::StrCat("coordinator: ", registered, " of ",
                                               on_mesh() ? options_.mesh.world() : 1,
                                               " workers registered yet; retry"));
  }
  if (!req.base_model().empty() && req.base_model() != model_path_) {
    return absl::InvalidArgumentError(absl::StrCat("base_model: workers serve '", model_path_,
                                                   "', not '", req.base_model(), "'"));
  }
  const std::string fingerprint = absl::StrCat(owner, "\n", RequestFingerprint(req));
  auto prior = create_requests_.find(req.request_id());
  if (prior != create_requests_.end()) {  // retried CreateRun: the run it made
    if (runs_.count(prior->second.first) && runs_.at(prior->second.first)->run.owner() != owner) {
      return absl::InvalidArgumentError("request_id: already used; a new run needs a new request_id");
    }
    if (prior->second.second != fingerprint) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request_id: '", req.request_id(), "' already created run '", prior->second.first,
          "' from a different CreateRun request; a new run needs a new request_id"));
    }
    auto run = runs_.at(prior->second.first);
    lock.unlock();
    std::lock_guard<std::mutex> run_lock(run->mu);
    return run->run;
  }
  if (creating_requests_.count(req.request_id())) {
    return absl::UnavailableError("request_id: this CreateRun is still in progress; retry");
  }
  if (runs_.size() + creating_ids_.size() >= options_.max_runs) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_runs: ", runs_.size(), " runs exist, the limit of this coordinator; DeleteRun one first"));
  }
  if (!owner.empty()) {  // one key cannot take every slot of --max_runs from the others
    size_t held = creating_owners_.count(owner);
    for (const auto& [id, r] : runs_) held += r->run.owner() == owner ? 1 : 0;
    if (held >= options_.max_runs_per_owner) {
      return absl::ResourceExhaustedError(absl::StrCat("max_runs_per_key: '", owner, "' holds ", held,
                                                       " runs, the limit per API key; DeleteRun one first"));
    }
  }
  std::string run_id = id_prefix + req.run_id();
  if (req.run_id().empty()) {
    do {
      run_id = absl::StrCat(id_prefix, "run-", next_run_number_++);
    } while (runs_.count(run_id) || creating_ids_.count(run_id));
  } else if (absl::Status named = ValidateStoreName(req.run_id(), "run_id"); !named.ok()) {
    return named;  // run ids name state-store folders: the same rules
  } else if (run_id.size() > kMaxStoreNameBytes) {  // the owner's prefix counts too
    return absl::InvalidArgumentError(absl::StrCat("run_id: at most ", kMaxStoreNameBytes - id_prefix.size(),
                                                   " bytes with API keys"));
  } else if (runs_.count(run_id) || creating_ids_.count(run_id)) {
    return absl::AlreadyExistsError(absl::StrCat("run_id: '", req.run_id(), "' exists"));
  }
  auto state = std::make_shared<RunState>();
  LORASTEP_ASSIGN_OR_RETURN(state->ranks, PlaceRun());
  state->run.set_run_id(run_id);
  state->run.set_base_model(model_path_);
  LoraConfigToProto(lora, state->run.mutable_lora());
  state->run.set_seed(req.seed());
  state->run.set_next_sequence_id(1);
  state->run.set_created_unix_ms(NowMs());
  state->run.set_owner(owner);
  state->run.set_last_step(-1);
  // The id is reserved while the worker builds the run; the run is visible only once built.
  creating_ids_.insert(run_id);
  creating_requests_.insert(req.request_id());
  if (!owner.empty()) creating_owners_.insert(owner);
  auto done_creating = [&] {  // under mu_
    creating_ids_.erase(run_id);
    creating_requests_.erase(req.request_id());
    if (!owner.empty()) creating_owners_.erase(creating_owners_.find(owner));
  };
  lock.unlock();
  if (options_.journal != nullptr) {  // journaled before it exists: a run is never unrecorded
    v1::JournalRun journaled;
    *journaled.mutable_run() = state->run;
    journaled.set_create_request_id(req.request_id());
    journaled.set_create_fingerprint(fingerprint);
    journaled.set_init_from(req.init_from());
    journaled.set_init_with_optimizer(req.init_with_optimizer());
    if (absl::Status s = options_.journal->AddRun(journaled); !s.ok()) {
      lock.lock();
      done_creating();
      return s;
    }
  }
  v1::WorkerCreateRunRequest wreq;
  wreq.set_run_id(run_id);
  *wreq.mutable_lora() = state->run.lora();
  wreq.set_seed(req.seed());
  wreq.set_init_from(req.init_from());
  wreq.set_init_with_optimizer(req.init_with_optimizer());
  // Same seed on every rank: replicas start bitwise equal.
  auto created = FanOut<v1::WorkerCreateRunResponse>(*state, AllRanks(*state), [&](int, WorkerClient* w) {
    v1::WorkerCreateRunRequest call = wreq;
    StampMesh(call.mutable_mesh());  // init_from loads collectively
    return w->CreateRun(call);
  });
  if (!created.ok() && options_.journal != nullptr) {
    if (absl::Status s = options_.journal->RemoveRun(run_id); !s.ok()) {
      LORASTEP_LOG(Error) << "journal: " << s;
    }
  }
  lock.lock();
  done_creating();
  if (!created.ok()) return created.status();
  state->run.set_learner_version((*created)[0].learner_version());  // a checkpoint's, with its optimizer
  runs_[run_id] = state;
  create_requests_[req.request_id()] = {run_id, fingerprint};
  if (options_.metrics != nullptr) {
    options_.metrics->Set("lorastep_runs", {}, static_cast<double>(runs_.size()));
    options_.metrics->Set("lorastep_learner_version", {{"run", run_id}}, static_cast<double>(state->run.learner_version()));
  }
  return state->run;
}

absl::Status Coordinator::DeleteRun(const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  std::unique_lock<std::mutex> run_lock(run->mu);  // after any call in flight on it
  bool on_down_worker = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (runs_.count(run_id) == 0 || runs_.at(run_id) != run) {  // a concurrent DeleteRun won
      return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
    }
    for (const WorkerClient* w : run->ranks) on_down_worker = on_down_worker || down_.count(w) > 0;
  }
  v1::WorkerDeleteRunRequest wreq;
  wreq.set_run_id(run_id);
  // A run on a dead worker has no state left to free there: it is only forgotten.
  if (!on_down_worker) LORASTEP_RETURN_IF_ERROR(FanOut<bool>(*run, AllRanks(*run), [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
                             LORASTEP_RETURN_IF_ERROR(w->DeleteRun(wreq));
                             return true;
                           }).status());
  if (options_.journal != nullptr) {
    {
      // A background autosave still being written is awaited (for a while) so it is removed
      // with the others rather than landing after them.
      std::unique_lock<std::mutex> lock(run->autosave_mu);
      run->autosave_cv.wait_for(lock, std::chrono::seconds(60), [&] { return !run->autosave_in_flight; });
      run->retired = true;
    }
    if (!on_down_worker) DeleteAutosaves(*run, "");  // of no use any more (best effort)
    LORASTEP_RETURN_IF_ERROR(options_.journal->RemoveRun(run_id));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    runs_.erase(run_id);
    for (auto it = create_requests_.begin(); it != create_requests_.end();) {
      it = it->second.first == run_id ? create_requests_.erase(it) : std::next(it);
    }
    if (options_.metrics != nullptr) {
      options_.metrics->RemoveSeries("run", run_id);
      options_.metrics->Set("lorastep_runs", {}, static_cast<double>(runs_.size()));
    }
  }
  // A deleted run's history and records go back to the OS, not just to malloc: trimmed once
  // they are freed (this was the last reference; trimming before it let the first 10,000
  // steps of 16 clients leave 15-21 MB behind).
  run_lock.unlock();
  run.reset();
  malloc_trim(0);
  return absl::OkStatus();
}

absl::StatusOr<v1::Run> Coordinator::GetRun(const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  std::lock_guard<std::mutex> lock(run->view_mu);
  return run->run;
}

std::vector<v1::Run> Coordinator::ListRuns() {
  std::vector<std::shared_ptr<RunState>> runs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : runs_) runs.push_back(r);
  }
  std::vector<v1::Run> out;
  for (auto& r : runs) {
    std::lock_guard<std::mutex> lock(r->view_mu);
    out.push_back(r->run);
  }
  return out;
}

absl::StatusOr<bool> Coordinator::Replay(RunState& run, const std::string& method,
                                         const std::string& request_id, int64_t sequence_id,
                                         const google::protobuf::Message& request,
                                         google::protobuf::Message* out, bool defer_fingerprint) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(request_id));
  auto it = run.recorded.find(request_id);
  // A new request's fingerprint is only stored (by Record): a caller may defer it.
  run.current_fingerprint = it != run.recorded.end() || !defer_fingerprint ? RequestFingerprint(request) : "";
  if (it != run.recorded.end()) {
    if (it->second.method != method) {
      return absl::InvalidArgumentError(absl::StrCat("request_id: '", request_id,
                                                     "' was used for ", it->second.method));
    }
    if (it->second.evicted) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request_id: '", request_id, "' was applied, but its response is no longer kept (the "
          "run's recorded responses exceeded --max_recorded_mb); nothing was applied again"));
    }
    if (it->second.fingerprint != run.current_fingerprint) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request_id: '", request_id, "' was already used for a different ", method,
          " request (the payload differs); a retry must resend the same request, a new "
          "request needs a new request_id"));
    }
    out->ParseFromString(it->second.response);
    return true;
  }
  if (sequence_id != run.run.next_sequence_id()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence_id: expected ",
                                                      run.run.next_sequence_id(), ", got ",
                                                      sequence_id, run.restored_note));
  }
  return false;
}

void Coordinator::Record(RunState& run, const std::string& method, const std::string& request_id,
                         const google::protobuf::Message& response, bool with_step) {
  const std::string serialized = response.SerializeAsString();
  KeepRecord(run, request_id, method, serialized, run.current_fingerprint);
  v1::JournalEntry entry;
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_next_sequence_id(run.run.next_sequence_id() + 1);
    if (options_.journal == nullptr) return;
    *entry.mutable_run() = run.run;
    if (with_step && !run.history.empty()) *entry.mutable_step() = run.history.back();
  }
  // Before the response leaves (outside the view lock: readers never wait for the disk).
  // The call is applied on the workers already: a failed write cannot undo it, so it is
  // logged (the run then restarts from its previous autosave).
  entry.set_request_id(request_id);
  entry.set_method(method);
  entry.set_fingerprint(run.current_fingerprint);
  entry.set_response(serialized);
  if (absl::Status s = options_.journal->Append(run.run.run_id(), entry, /*sync=*/false); !s.ok()) {
    LORASTEP_LOG(Error) << "journal: run " << run.run.run_id() << ": " << s;
  }
}

void Coordinator::KeepRecord(RunState& run, const std::string& request_id, const std::string& method,
                             const std::string& response, const std::string& fingerprint) {
  RunState::Recorded& rec = run.recorded[request_id];
  rec = {method, response, fingerprint, false};
  run.recorded_bytes += rec.response.size();
  run.recorded_order.push_back(request_id);
  while (run.recorded_order.size() > options_.max_recorded_requests) {
    RunState::Recorded& old = run.recorded.at(run.recorded_order.front());
    run.recorded_bytes -= old.response.size();
    run.recorded.erase(run.recorded_order.front());
    run.recorded_order.pop_front();
  }
  // Bounded memory: drop the oldest responses' bodies (log-probs can be large) but keep
  // their ids and fingerprints, so a late retry is refused rather than applied twice.
  for (const std::string& id : run.recorded_order) {
    if (run.recorded_bytes <= options_.max_recorded_bytes) break;
    RunState::Recorded& old = run.recorded.at(id);
    if (old.evicted || id == request_id) continue;
    run.recorded_bytes -= old.response.size();
    old.response = std::string();
    old.evicted = true;
  }
}

void Coordinator::MaybeAutosave(RunState& run, bool force) {
  if (options_.journal == nullptr) return;
  const int64_t version = run.run.learner_version();
  const int every = run.run.lora().rank() == 0 ? options_.autosave_every_full_steps : options_.autosave_every_steps;
  const auto started = std::chrono::steady_clock::now();
  bool due;
  {
    std::lock_guard<std::mutex> lock(run.autosave_mu);
    due = force ||
          (every > 0 ? version % every == 0
                     : run.last_autosave_s < 0 ||  // spaced by cost: not too soon after the last one
                           std::chrono::duration<double>(started - run.last_autosave_end).count() *
                                   options_.autosave_max_share >=
                               run.last_autosave_s);
  }
  if (!due) return;
  std::string name;
  {
    // One background write per run at a time (memory holds one copy of the state). Spaced by
    // cost, a step during it is too soon anyway (the write is the cost); otherwise the step
    // waits for it, so every due step is saved where it happened and the disk sets the pace
    // only when it is slower than the steps. (Skipping the step's autosave instead and saving
    // later could not save a state with a ForwardBackward's gradients pending, and left the
    // run behind.)
    std::unique_lock<std::mutex> lock(run.autosave_mu);
    if (run.autosave_in_flight && !force && every <= 0) return;
    run.autosave_cv.wait(lock, [&] { return !run.autosave_in_flight; });
    name = absl::StrCat("autosave-", run.next_autosave++);
  }
  const std::string& run_id = run.run.run_id();
  const bool background = options_.autosave_in_background;
  auto saved = FanOut<v1::WorkerPathResponse>(run, AllRanks(run), [&](int, WorkerClient* w) {
    v1::WorkerPathRequest wreq = PathRequest(run_id, AutosaveRef(run_id, name));
    wreq.set_background(background);
    StampMesh(wreq.mutable_mesh());
    return w->SaveState(wreq);
  });
  if (!saved.ok()) {  // the step stands; a restart would resume from the previous autosave
    LORASTEP_LOG(Error) << "autosave of run " << run_id << " at learner_version " << version << ": " << saved.status();
    return;
  }
  run.step_since_autosave = false;  // callers hold run.mu
  // The marker goes where the state was taken, between this call's record and the next's;
  // a background one is pending until the confirmation journals it as durable (fsynced).
  v1::JournalEntry marker;
  marker.set_autosave_marker(true);
  marker.set_autosave_name(name);
  marker.set_autosave_pending(background);
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    *marker.mutable_run() = run.run;
  }
  if (absl::Status s = options_.journal->Append(run_id, marker, /*sync=*/!background); !s.ok()) {
    LORASTEP_LOG(Error) << "journal: run " << run_id << ": " << s;
    return;
  }
  std::unique_lock<std::mutex> lock(run.autosave_mu);
  if (!background) {
    run.last_autosave_end = std::chrono::steady_clock::now();
    run.last_autosave_s = std::chrono::duration<double>(run.last_autosave_end - started).count();
    const std::string previous = RecordDurableAutosave(run, name, version);
    lock.unlock();
    return RemoveAutosave(run, previous);
  }
  run.autosave_in_flight = true;
  ++autosaves_submitted_;
  // Rank 0 writes the (gathered) state; the others copied nothing to write.
  autosave_confirmations_.Submit([this, state = run.shared_from_this(), writer = run.ranks[0], id = run_id, name,
                                  version, started] {
    absl::Status written = writer->AwaitSaved(PathRequest(id, AutosaveRef(id, name)));
    std::unique_lock<std::mutex> lock(state->autosave_mu);
    state->last_autosave_end = std::chrono::steady_clock::now();
    state->last_autosave_s = std::chrono::duration<double>(state->last_autosave_end - started).count();
    std::string previous;
    if (!state->retired) {
      v1::JournalEntry done;
      done.set_autosave_done(name);
      if (written.ok()) written = options_.journal->Append(id, done, /*sync=*/true);
      if (written.ok()) {
        previous = RecordDurableAutosave(*state, name, version);
      } else {  // a restart would resume from the previous autosave
        LORASTEP_LOG(Error) << "autosave " << name << " of run " << id << ": " << written;
        if (options_.metrics != nullptr) options_.metrics->Add("lorastep_autosave_failures_total", {{"run", id}});
      }
    }
    state->autosave_in_flight = false;
    state->autosave_cv.notify_all();
    lock.unlock();
    // Not under autosave_mu: removing 246 MB took ~80 ms on the H200 host, and the next
    // step's autosave waited for it. The journal names `name` now: a restore never needs
    // `previous` again.
    RemoveAutosave(*state, previous);
  });
}

std::string Coordinator::RecordDurableAutosave(RunState& run, const std::string& name, int64_t version) {
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_autosaved_learner_version(version);
  }
  const std::string previous = std::exchange(run.durable_autosave, name);
  return previous == name ? "" : previous;
}

void Coordinator::RemoveAutosave(RunState& run, const std::string& name) {
  if (name.empty()) return;
  v1::DeleteCheckpointRequest del;  // an autosave a restart no longer needs (best effort)
  del.set_run_id(run.run.run_id());
  del.set_name(name);
  if (absl::Status s = run.ranks[0]->DeleteCheckpoint(del); !s.ok() && !absl::IsNotFound(s)) {
    LORASTEP_LOG(Warning) << "run " << run.run.run_id() << ": removing the autosave " << name << ": " << s;
  }
}

void Coordinator::DeleteAutosaves(RunState& run, const std::string& keep) {
  v1::ListCheckpointsRequest list;
  list.set_run_id(run.run.run_id());
  auto listed = run.ranks[0]->ListCheckpoints(list);
  if (!listed.ok()) return;  // best effort: a worker without a store, or down
  for (const auto& c : listed->checkpoints()) {
    if (IsAutosaveName(c.name()) && c.name() != keep) RemoveAutosave(run, c.name());
  }
}

bool Coordinator::WaitForAutosaves(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {  // until no autosave started after the barrier (a step's, racing the shutdown)
    const int64_t submitted = autosaves_submitted_.load();
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> finished = done->get_future();
    autosave_confirmations_.Submit([done] { done->set_value(); });  // after every confirmation queued so far
    if (finished.wait_until(deadline) != std::future_status::ready) return false;
    if (autosaves_submitted_.load() == submitted) return true;
  }
}

void Coordinator::CancelWorkerCalls() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& w : workers_) {
    if (w != nullptr) w->CancelInFlight();
  }
}

absl::StatusOr<int> Coordinator::RestoreRuns() {
  if (options_.journal == nullptr) return 0;
  std::vector<absl::Status> skipped;
  LORASTEP_ASSIGN_OR_RETURN(std::vector<JournaledRun> journaled, options_.journal->Recover(&skipped));
  for (const absl::Status& s : skipped) LORASTEP_LOG(Error) << "journal: a run was not restored: " << s;
  int restored = 0;
  for (JournaledRun& j : journaled) {
    if (absl::Status s = RestoreRun(j); !s.ok()) {
      LORASTEP_LOG(Error) << "run " << j.created.run().run_id() << " was not restored (it stays in the journal): " << s;
      continue;
    }
    ++restored;
    LORASTEP_LOG(Info) << "run " << j.run.run_id() << " restored at learner_version " << j.run.learner_version()
                       << ", next_sequence_id " << j.run.next_sequence_id()
                       << (j.autosaved ? " (from its autosave)" : " (as created: no step was autosaved)");
  }
  return restored;
}

absl::StatusOr<std::vector<WorkerClient*>> Coordinator::PlaceRun() const {
  std::vector<WorkerClient*> up;
  for (const auto& w : workers_) {
    if (w != nullptr && !down_.count(w.get())) up.push_back(w.get());
  }
  if (on_mesh()) {  // every rank, in rank order
    if (up.size() < static_cast<size_t>(options_.mesh.world())) {
      return absl::UnavailableError("coordinator: a rank of the mesh is down; restart the mesh");
    }
    return up;
  }
  if (up.empty()) return absl::UnavailableError("coordinator: no worker is up; retry when one registers");
  return std::vector<WorkerClient*>{up[(runs_.size() + creating_ids_.size()) % up.size()]};  // round robin
}

absl::Status Coordinator::RestoreRun(const JournaledRun& j, WorkerClient* onto) {
  const std::string run_id = j.created.run().run_id();
  auto state = std::make_shared<RunState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (runs_.count(run_id)) return absl::AlreadyExistsError(absl::StrCat("run_id: '", run_id, "' exists"));
    if (onto != nullptr && !down_.count(onto)) {
      state->ranks = {onto};
    } else {
      LORASTEP_ASSIGN_OR_RETURN(state->ranks, PlaceRun());
    }
  }
  state->run = j.created.run();
  v1::WorkerCreateRunRequest create;
  create.set_run_id(run_id);
  *create.mutable_lora() = j.created.run().lora();
  create.set_seed(j.created.run().seed());
  if (!j.autosaved) {  // no step was saved: the run as it was created
    create.set_init_from(j.created.init_from());
    create.set_init_with_optimizer(j.created.init_with_optimizer());
  }
  auto create_on_ranks = [&] {
    return FanOut<v1::WorkerCreateRunResponse>(*state, AllRanks(*state), [&](int, WorkerClient* w) {
      v1::WorkerCreateRunRequest call = create;
      StampMesh(call.mutable_mesh());
      return w->CreateRun(call);
    });
  };
  auto delete_on_ranks = [&] {  // best effort: what a failed restore left on the workers
    v1::WorkerDeleteRunRequest del;
    del.set_run_id(run_id);
    FanOut<bool>(*state, AllRanks(*state), [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
      LORASTEP_RETURN_IF_ERROR(w->DeleteRun(del));
      return true;
    }).IgnoreError();
  };
  auto created = create_on_ranks();
  if (absl::IsAlreadyExists(created.status())) {  // workers that outlived the coordinator
    delete_on_ranks();
    created = create_on_ranks();
  }
  LORASTEP_RETURN_IF_ERROR(created.status());
  int64_t version = (*created)[0].learner_version();
  if (j.autosaved) {
    auto loaded = FanOut<v1::WorkerPathResponse>(*state, AllRanks(*state), [&](int, WorkerClient* w) {
      v1::WorkerPathRequest wreq = PathRequest(run_id, AutosaveRef(run_id, j.autosave_name));
      // Unique per restore: a worker answers a request_id it has seen from its record.
      *wreq.mutable_mesh() = MeshHeader(*state, absl::StrCat("restore-", run_id, "-", NowMs(), "-", ++restore_count_),
                                        /*check_version=*/false);
      StampMesh(wreq.mutable_mesh());
      return w->LoadState(wreq);
    });
    if (!loaded.ok() || (*loaded)[0].learner_version() != j.run.learner_version()) {
      delete_on_ranks();
      if (absl::IsNotFound(loaded.status()) && j.newer_pending != nullptr) {
        // The journal's tail was torn, and with it, it seems, the record that made the newer
        // autosave durable (the older one is removed once a newer one is): restore from it.
        LORASTEP_LOG(Warning) << "run " << run_id << ": " << AutosaveRef(run_id, j.autosave_name)
                              << " is gone; restoring from " << AutosaveRef(run_id, j.newer_pending->autosave_name)
                              << ", whose durable record the torn journal tail held";
        return RestoreRun(*j.newer_pending, onto);
      }
      if (!loaded.ok()) return loaded.status();
      return absl::DataLossError(absl::StrCat(AutosaveRef(run_id, j.autosave_name), " holds learner_version ",
                                              (*loaded)[0].learner_version(), ", the journal ",
                                              j.run.learner_version()));
    }
    version = (*loaded)[0].learner_version();
  }
  // The journal says from here on exactly what was restored, before the run takes a call.
  if (absl::Status settled = options_.journal->Settle(j); !settled.ok()) {
    delete_on_ranks();
    return settled;
  }
  state->run = j.run;
  state->run.set_learner_version(version);
  state->run.set_pending_forward_backward(0);
  // Autosaves that never became durable (or that a crash kept from being removed) go.
  state->durable_autosave = j.autosave_name;
  state->next_autosave = AutosaveNumber(j.autosave_name) + 1;
  if (j.autosaved) {
    state->run.set_autosaved_learner_version(version);
  } else {
    state->run.clear_autosaved_learner_version();
  }
  DeleteAutosaves(*state, j.autosave_name);
  state->restored_note = absl::StrCat(" (the run was restored after a restart at learner_version ", version,
                                      ", next_sequence_id ", j.run.next_sequence_id(),
                                      "; calls after its last autosave were dropped)");
  for (const v1::JournalEntry& e : j.entries) {
    if (e.autosave_marker()) continue;
    KeepRecord(*state, e.request_id(), e.method(), e.response(), e.fingerprint());
    if (e.has_step()) {
      state->history.push_back(e.step());
      state->next_step = e.step().step() + 1;
      while (state->history.size() > options_.max_step_history) state->history.pop_front();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  runs_[run_id] = state;
  create_requests_[j.created.create_request_id()] = {run_id, j.created.create_fingerprint()};
  if (options_.metrics != nullptr) {
    options_.metrics->Set("lorastep_runs", {}, static_cast<double>(runs_.size()));
    options_.metrics->Set("lorastep_learner_version", {{"run", run_id}}, static_cast<double>(version));
  }
  return absl::OkStatus();
}

int64_t Coordinator::AppendStep(RunState& run, const std::string& kind,
                                const v1::StepResponse& step) {
  v1::StepRecord record;
  record.set_step(run.next_step++);
  record.set_kind(kind);
  record.set_learner_version(step.learner_version());
  record.set_unix_time_ms(NowMs());
  record.set_adapter_sha256(step.adapter_sha256());
  *record.mutable_metrics() = step.metrics();
  *record.mutable_replica_hashes() = step.replica_hashes();
  record.set_replicas_equal(step.replicas_equal());
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.history.push_back(record);
    while (run.history.size() > options_.max_step_history) run.history.pop_front();
    run.run.set_last_step(record.step());
    run.run.set_last_step_unix_ms(record.unix_time_ms());
  }
  RecordStepMetrics(options_.metrics, run.run.run_id(), kind, step.metrics(), step.learner_version(),
                    on_mesh() ? (step.replicas_equal() ? 1 : 0) : -1);
  std::lock_guard<std::mutex> lock(run.watch_mu);
  for (auto& [id, w] : run.watchers) w(record);
  return record.step();
}

bool Coordinator::WorkerValidatesAlone(const RunState& run) const {
  return run.ranks.size() == 1 && run.ranks[0]->ValidatesBatchesAsCoordinator();
}

absl::StatusOr<std::optional<BatchTotals>> Coordinator::ValidatedTotals(const RunState& run,
                                                                        const std::vector<Datum>& datums,
                                                                        const v1::LossConfig& loss_proto,
                                                                        bool own_totals_needed) {
  if (WorkerValidatesAlone(run) && !own_totals_needed) return std::nullopt;
  LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(loss_proto));
  LORASTEP_RETURN_IF_ERROR(ValidateBatch(datums, loss, vocab_size(), options_.limits));
  // The batch-wide denominators travel with it, so a shard normalizes like the whole batch
  // (data-parallel shards on several workers use the same totals).
  return ComputeBatchTotals(datums);
}

size_t Coordinator::RegisteredWorkers() const {
  return std::count_if(workers_.begin(), workers_.end(), [](const auto& w) { return w != nullptr; });
}

const std::vector<int>& Coordinator::ShardOfRank(const std::vector<std::vector<int>>& shards,
                                                 int rank) const {
  return shards[on_mesh() ? layout_.Coords(rank).dp : 0];
}

std::vector<int> Coordinator::AllRanks(const RunState& run) const {
  std::vector<int> ranks(run.ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  return ranks;
}

v1::MeshCall Coordinator::MeshHeader(const RunState& run, const std::string& request_id,
                                     bool check_version) {
  v1::MeshCall mesh;
  mesh.set_request_id(request_id);
  mesh.set_expected_learner_version(check_version ? run.run.learner_version() : -1);
  return mesh;  // generation: filled by FanOut under the mesh lock
}

void Coordinator::StampMesh(v1::MeshCall* mesh) {
  mesh->set_mesh_generation(mesh_generation_);
  if (options_.mesh_by_registration) {
    std::lock_guard<std::mutex> lock(mu_);
    mesh->set_rendezvous(rendezvous_);
  }
}

template <typename Resp>
absl::StatusOr<std::vector<Resp>> Coordinator::FanOut(
    RunState& run, const std::vector<int>& ranks,
    const std::function<absl::StatusOr<Resp>(int rank, WorkerClient*)>& call) {
  // Every rank of a mesh must see the calls in one order. At world size 1 a run lives on one
  // worker, whose own lock orders its calls: runs on different workers must not wait for
  // each other here (they did, a whole worker call each, under this lock).
  std::unique_lock<FairMutex> mesh_lock(mesh_mu_, std::defer_lock);
  if (on_mesh()) mesh_lock.lock();
  {
    // A run on a worker known to be down fails at once, and never reaches a process that
    // has since taken the dead one's address.
    std::lock_guard<std::mutex> lock(mu_);
    if (mesh_regenerate_ && on_mesh()) {
      mesh_generation_ = NewMeshGeneration(mesh_generation_);
      mesh_regenerate_ = false;
    }
    for (int r : ranks) {
      if (down_.count(run.ranks[r])) {
        return absl::UnavailableError(absl::StrCat("worker ", run.ranks[r]->address(), " is down: ", WhatHappensToDownRuns()));
      }
    }
  }
  std::vector<absl::StatusOr<Resp>> results(ranks.size(), absl::UnknownError("not run"));
  std::set<int> unanswered;  // ranks cancelled after a peer's collective timed out waiting for them
  if (ranks.size() == 1) {
    results[0] = call(ranks[0], run.ranks[ranks[0]]);
  } else {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<bool> finished(ranks.size(), false);
    size_t done = 0;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] {
        absl::StatusOr<Resp> r = call(ranks[i], run.ranks[ranks[i]]);
        std::lock_guard<std::mutex> lock(mu);
        results[i] = std::move(r);
        finished[i] = true;
        ++done;
        cv.notify_all();
      });
    }
    // After a rank fails, the others get peer_failure_grace to answer (they normally fail
    // at their collective timeout); then their calls are cancelled. A rank that failed only
    // because a peer did (its collective timed out waiting) starts the grace too: the peer
    // it waited for may be stopped or wedged and never answer at all.
    std::vector<bool> cancelled(ranks.size(), false);
    int root_rank = -1;
    {
      std::unique_lock<std::mutex> lock(mu);
      std::chrono::steady_clock::time_point deadline;
      while (done < ranks.size()) {
        if (root_rank < 0) {
          for (size_t i = 0; i < ranks.size(); ++i) {
            if (!finished[i] || results[i].ok()) continue;
            // A rank that failed on its own names the failure; else the first that failed.
            if (root_rank < 0 || !IsPeerFailure(results[i].status())) root_rank = ranks[i];
            if (!IsPeerFailure(results[i].status())) break;
          }
          if (root_rank < 0) {
            cv.wait(lock);
            continue;
          }
          deadline = std::chrono::steady_clock::now() + options_.peer_failure_grace;
        }
        if (cv.wait_until(lock, deadline) == std::cv_status::timeout && done < ranks.size()) {
          for (size_t i = 0; i < ranks.size(); ++i) {
            if (finished[i]) continue;
            cancelled[i] = true;
            run.ranks[ranks[i]]->CancelInFlight();
          }
          break;
        }
      }
    }
    for (auto& t : threads) t.join();
    const bool root_waited = root_rank >= 0 && [&] {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i] == root_rank) return IsPeerFailure(results[i].status());
      }
      return false;
    }();
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (!cancelled[i] || results[i].ok()) continue;
      results[i] = absl::DeadlineExceededError(absl::StrCat(
          "no answer ", options_.peer_failure_grace.count(), " s after rank ", root_rank,
          root_waited ? "'s collective timed out waiting for its peers; call cancelled (this worker is stopped, "
                        "wedged or unreachable)"
                      : " failed; call cancelled (the worker may still be blocked in a collective)"));
      // The rank that never answered is the cause when the first failure only waited for it.
      if (root_waited) unanswered.insert(ranks[i]);
    }
  }
  // A call that failed at the transport (the worker process is gone) marks its worker down;
  // a call cancelled by us, or one that failed inside a collective, does not.
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!results[i].ok() && absl::IsUnavailable(results[i].status()) && !IsPeerFailure(results[i].status())) {
      MarkDown(run.ranks[ranks[i]], results[i].status());
      results[i] = absl::UnavailableError(absl::StrCat(results[i].status().message(), " (worker ",
                                                       run.ranks[ranks[i]]->address(), " is down: ",
                                                       WhatHappensToDownRuns(), ")"));
    }
  }
  // Root causes first: a rank that failed on its own, before those that only saw a peer
  // fail (ABORTED by the outcome vote, a collective that timed out waiting for it, a call
  // cancelled after the grace).
  std::vector<std::pair<int, absl::Status>> failed;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!results[i].ok()) failed.push_back({ranks[i], results[i].status()});
  }
  if (!failed.empty()) {
    // Communicators may be broken: every rank rebuilds at the next call.
    if (on_mesh()) mesh_generation_ = NewMeshGeneration(mesh_generation_);
    auto cause = [&](const std::pair<int, absl::Status>& f) {
      return unanswered.count(f.first) > 0 || !IsPeerFailure(f.second);
    };
    std::stable_sort(failed.begin(), failed.end(),
                     [&](const auto& a, const auto& b) { return cause(a) && !cause(b); });
    if (!on_mesh()) return failed[0].second;
    std::string msg;
    for (const auto& [rank, status] : failed) {
      const RankCoords c = layout_.Coords(rank);
      absl::StrAppend(&msg, msg.empty() ? "" : "; ", "rank ", rank, " (tp", c.tp, " pp", c.pp,
                      " dp", c.dp, ", ", run.ranks[rank]->address(), "): ", status.message());
    }
    return absl::Status(failed[0].second.code(),
                        absl::StrCat(failed.size(), " of ", ranks.size(),
                                     " ranks failed; nothing was applied: ", msg));
  }
  std::vector<Resp> out;
  for (auto& r : results) out.push_back(std::move(r).value());
  return out;
}

absl::Status Coordinator::CheckShardable(int num_datums) {
  if (on_mesh() && num_datums < options_.mesh.dp) {
    return absl::InvalidArgumentError(absl::StrCat("datums: ", num_datums,
                                                   " datums cannot be split over dp = ",
                                                   options_.mesh.dp, " replicas"));
  }
  return absl::OkStatus();
}

std::vector<std::vector<int>> Coordinator::ShardsByTokens(const std::vector<Datum>& datums) {
  const int dp = on_mesh() ? options_.mesh.dp : 1;
  std::vector<std::vector<int>> shards(dp);
  // Longest first onto the lightest replica (LPT); each shard then back in request order.
  std::vector<int> order(datums.size());
  for (size_t i = 0; i < datums.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return datums[a].tokens.size() > datums[b].tokens.size();
  });
  std::vector<int64_t> load(dp, 0);
  for (int i : order) {
    const int lightest = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    shards[lightest].push_back(i);
    load[lightest] += static_cast<int64_t>(datums[i].tokens.size());
  }
  for (auto& shard : shards) std::sort(shard.begin(), shard.end());
  return shards;
}

v1::ForwardBackwardResponse Coordinator::MergeForward(
    const std::vector<std::vector<int>>& shards, int num_datums,
    const std::vector<v1::WorkerForwardBackwardResponse>& per_rank) {
  v1::ForwardBackwardResponse out;
  std::vector<Metrics> metrics;
  std::vector<bool> reporting;
  for (int i = 0; i < num_datums; ++i) out.add_logprobs();
  for (size_t r = 0; r < per_rank.size(); ++r) {
    metrics.push_back(MetricsFromPartials(per_rank[r].partials()));
    const RankCoords c = layout_.Coords(static_cast<int>(r));
    const bool reports = c.tp == 0 && c.pp == options_.mesh.pp - 1;
    reporting.push_back(reports);
    if (!reports) continue;
    const std::vector<int>& shard = ShardOfRank(shards, static_cast<int>(r));
    for (size_t j = 0; j < shard.size(); ++j) {
      *out.mutable_logprobs(shard[j]) = per_rank[r].result().logprobs(static_cast<int>(j));
    }
  }
  MetricsToProto(MergeRankMetrics(metrics, reporting), out.mutable_metrics());
  return out;
}

void Coordinator::CheckReplicas(RunState& run, const std::vector<v1::WorkerStepResponse>& per_rank,
                                v1::StepResponse* resp) {
  if (!on_mesh()) return;
  bool all_equal = true;
  std::string diverged;
  // (stage, tensor rank or -1, ep rank or -1, family) -> ranks that hold a copy
  std::map<std::tuple<int, int, int, std::string>, std::vector<int>> families;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const RankCoords c = layout_.Coords(static_cast<int>(r));
    for (const auto& [family, sha] : per_rank[r].replica_digests()) {
      const ReplicaScope scope = ReplicaFamilyScope(family);
      families[{c.pp, scope.per_tensor_rank ? c.tp : -1, scope.per_expert_rank ? c.ep : -1, family}]
          .push_back(static_cast<int>(r));
    }
  }
  for (const auto& [key, ranks] : families) {
    const auto& [stage, tensor_rank, expert_rank, family] = key;
    v1::ReplicaHash* h = resp->add_replica_hashes();
    h->set_stage(stage);
    h->set_tensor_rank(tensor_rank);
    h->set_expert_rank(expert_rank);
    h->set_family(family);
    const std::string& first = per_rank[ranks[0]].replica_digests().at(family);
    h->set_sha256(first);
    bool equal = true;
    std::vector<int> differing;
    for (int r : ranks) {
      h->add_ranks(r);
      if (per_rank[r].replica_digests().at(family) != first) {
        equal = false;
        differing.push_back(r);
      }
    }
    h->set_equal(equal);
    if (!equal) {
      for (int r : ranks) h->add_sha256_by_rank(per_rank[r].replica_digests().at(family));
      all_equal = false;
      absl::StrAppend(&diverged, diverged.empty() ? "" : "; ", "stage ", stage, " ", family,
                      tensor_rank >= 0 ? absl::StrCat(" (tensor rank ", tensor_rank, ")") : "",
                      expert_rank >= 0 ? absl::StrCat(" (ep rank ", expert_rank, ")") : "",
                      ": ranks ", absl::StrJoin(differing, ","), " differ from rank ", ranks[0]);
    }
  }
  resp->set_replicas_equal(all_equal);
  if (!all_equal) {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_diverged(absl::StrCat("replicas diverged after learner_version ",
                                      resp->learner_version(), ": ", diverged));
  }
}

absl::StatusOr<v1::StepResponse> Coordinator::MergeSteps(RunState& run,
                                                          std::vector<v1::WorkerStepResponse> per_rank) {
  if (!on_mesh()) {
    v1::StepResponse resp = std::move(*per_rank[0].mutable_result());
    resp.set_replicas_equal(true);  // one copy: nothing to compare
    return resp;
  }
  v1::StepResponse resp = per_rank[0].result();
  std::vector<Metrics> metrics;
  std::vector<bool> reporting;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    metrics.push_back(MetricsFromPartials(per_rank[r].partials()));
    const RankCoords c = layout_.Coords(static_cast<int>(r));
    reporting.push_back(c.tp == 0 && c.pp == options_.mesh.pp - 1);
  }
  resp.clear_metrics();
  MetricsToProto(MergeRankMetrics(metrics, reporting), resp.mutable_metrics());
  CheckReplicas(run, per_rank, &resp);
  return resp;
}

absl::Status Coordinator::CheckNotDiverged(const RunState& run) {
  if (run.run.diverged().empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("run '", run.run.run_id(), "' is diverged (", run.run.diverged(),
                   "); LoadState a checkpoint to continue"));
}

void Coordinator::CommitStep(RunState& run, const std::string& method, const std::string& kind,
                             const std::string& request_id, v1::StepResponse* resp) {
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_learner_version(resp->learner_version());
    run.run.set_pending_forward_backward(0);
  }
  resp->set_step(AppendStep(run, kind, *resp));
  Record(run, method, request_id, *resp, /*with_step=*/true);
  run.last_change = std::chrono::steady_clock::now();
  run.step_since_autosave = true;
  MaybeAutosave(run, /*force=*/false);
}

void Coordinator::IdleAutosaveLoop() {
  const auto idle = options_.autosave_when_idle;
  const auto tick = std::max(std::chrono::milliseconds(100), std::min(idle / 4, std::chrono::milliseconds(1000)));
  std::unique_lock<std::mutex> lock(mu_);
  while (!restart_cv_.wait_for(lock, tick, [&] { return stopping_; })) {
    std::vector<std::shared_ptr<RunState>> runs;
    for (const auto& [id, run] : runs_) runs.push_back(run);
    lock.unlock();
    for (const auto& run : runs) {
      // A run with a call in flight is not idle: its own call saves it if due.
      std::unique_lock<std::mutex> run_lock(run->mu, std::try_to_lock);
      if (!run_lock.owns_lock() || !run->step_since_autosave ||
          std::chrono::steady_clock::now() - run->last_change < idle) {
        continue;
      }
      // Gradients of a pending ForwardBackward are not in an autosave, and its record would
      // sit before the marker: such a run waits for its OptimStep.
      if (run->run.pending_forward_backward() > 0 || !run->run.diverged().empty()) continue;
      {
        std::lock_guard<std::mutex> autosave_lock(run->autosave_mu);
        if (run->retired || run->autosave_in_flight) continue;
      }
      {
        std::lock_guard<std::mutex> guard(mu_);
        if (std::any_of(run->ranks.begin(), run->ranks.end(), [&](WorkerClient* w) { return down_.count(w) > 0; })) {
          continue;  // comes back from the autosave it has
        }
      }
      run->last_change = std::chrono::steady_clock::now();  // one that fails is tried an idle period later
      MaybeAutosave(*run, /*force=*/true);
    }
    lock.lock();
  }
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::ForwardBackward(
    const v1::ForwardBackwardRequest& req, Deadline deadline) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::ForwardBackwardResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed, Replay(*run, "ForwardBackward", req.request_id(),
                                                  req.sequence_id(), req, &resp, /*defer_fingerprint=*/true));
  if (replayed) return resp;
  FingerprintTask fingerprint(req.run_id(), req);
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum> datums, RequestDatums(req.datums(), req.packed_datums()));
  LORASTEP_ASSIGN_OR_RETURN(std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, datums, req.loss(), /*own_totals_needed=*/req.has_batch_totals()));
  LORASTEP_RETURN_IF_ERROR(CheckResponseFits(datums, req.max_response_bytes()));
  if (req.has_batch_totals()) {  // this call is part of a larger batch
    const v1::BatchTotals& whole = req.batch_totals();
    for (const auto& [name, value, own] : {std::tuple<const char*, double, double>{"loss_tokens", whole.loss_tokens(), totals->loss_tokens},
                                           {"samples", whole.samples(), totals->samples}}) {
      if (!std::isfinite(value) || value < own || value > 1e15) {
        return absl::InvalidArgumentError(absl::StrCat(
            "batch_totals.", name, ": ", value, " must be finite and at least this call's own ", own));
      }
    }
    totals->loss_tokens = whole.loss_tokens();
    totals->samples = whole.samples();
  }
  LORASTEP_RETURN_IF_ERROR(CheckShardable(static_cast<int>(datums.size())));
  const auto shards = ShardsByTokens(datums);
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank,
      FanOut<v1::WorkerForwardBackwardResponse>(
          *run, AllRanks(*run), [&](int rank, WorkerClient* w) {
            v1::WorkerForwardBackwardRequest wreq;
            wreq.set_run_id(req.run_id());
            *wreq.mutable_loss() = req.loss();
            if (totals) {
              wreq.set_batch_loss_tokens(totals->loss_tokens);
              wreq.set_batch_samples(totals->samples);
            }
            *wreq.mutable_mesh() = mesh;
            StampMesh(wreq.mutable_mesh());
            wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max());
        return w->ForwardBackward(wreq, BatchShard{&datums, &ShardOfRank(shards, rank), deadline});
          }));
  resp = on_mesh() ? MergeForward(shards, static_cast<int>(datums.size()), per_rank) : per_rank[0].result();
  {
    std::lock_guard<std::mutex> view(run->view_mu);
    run->run.set_pending_forward_backward(run->run.pending_forward_backward() + 1);
  }
  run->current_fingerprint = fingerprint.Get();
  Record(*run, "ForwardBackward", req.request_id(), resp);
  return resp;
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::Forward(const v1::ForwardRequest& req, Deadline deadline) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum> datums, RequestDatums(req.datums(), req.packed_datums()));
  if (!WorkerValidatesAlone(*run)) LORASTEP_RETURN_IF_ERROR(ValidateForwardBatch(datums, vocab_size(), options_.limits));
  LORASTEP_RETURN_IF_ERROR(CheckResponseFits(datums, req.max_response_bytes()));
  LORASTEP_RETURN_IF_ERROR(CheckShardable(static_cast<int>(datums.size())));
  const auto shards = ShardsByTokens(datums);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank,
      FanOut<v1::WorkerForwardBackwardResponse>(
          *run, AllRanks(*run), [&](int rank, WorkerClient* w) {
            v1::WorkerForwardRequest wreq;
            wreq.set_run_id(req.run_id());
            wreq.mutable_mesh()->set_expected_learner_version(-1);
            StampMesh(wreq.mutable_mesh());
            wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max());
        return w->Forward(wreq, BatchShard{&datums, &ShardOfRank(shards, rank), deadline});
          }));
  return on_mesh() ? MergeForward(shards, static_cast<int>(datums.size()), per_rank) : per_rank[0].result();
}

absl::StatusOr<v1::StepResponse> Coordinator::OptimStep(const v1::OptimStepRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "OptimStep", req.request_id(), req.sequence_id(), req, &resp));
  if (replayed) return resp;
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  LORASTEP_RETURN_IF_ERROR(ValidateClientMetrics(req.client_metrics()));
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::WorkerStepResponse>(*run, AllRanks(*run), [&](int, WorkerClient* w) {
        v1::WorkerOptimStepRequest wreq;
        wreq.set_run_id(req.run_id());
        *wreq.mutable_adamw() = req.adamw();
        *wreq.mutable_mesh() = mesh;
        StampMesh(wreq.mutable_mesh());
        return w->OptimStep(wreq);
      }));
  LORASTEP_ASSIGN_OR_RETURN(resp, MergeSteps(*run, std::move(per_rank)));
  AddClientMetrics(req.client_metrics(), &resp);
  CommitStep(*run, "OptimStep", "optim_step", req.request_id(), &resp);
  return resp;
}

absl::StatusOr<v1::StepResponse> Coordinator::TrainStep(const v1::TrainStepRequest& req, Deadline deadline) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "TrainStep", req.request_id(), req.sequence_id(), req, &resp,
                                   /*defer_fingerprint=*/true));
  if (replayed) return resp;
  FingerprintTask fingerprint(req.run_id(), req);
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  if (req.max_tokens_per_microbatch() < 0) {
    return absl::InvalidArgumentError("max_tokens_per_microbatch: must be >= 0");
  }
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  LORASTEP_RETURN_IF_ERROR(ValidateClientMetrics(req.client_metrics()));
  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum> datums, RequestDatums(req.datums(), req.packed_datums()));
  LORASTEP_ASSIGN_OR_RETURN(const std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, datums, req.loss(), /*own_totals_needed=*/false));
  LORASTEP_RETURN_IF_ERROR(CheckShardable(static_cast<int>(datums.size())));
  const auto shards = ShardsByTokens(datums);
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank,
      FanOut<v1::WorkerStepResponse>(*run, AllRanks(*run), [&](int rank, WorkerClient* w) {
        v1::WorkerTrainStepRequest wreq;
        wreq.set_run_id(req.run_id());
        *wreq.mutable_loss() = req.loss();
        *wreq.mutable_adamw() = req.adamw();
        if (totals) {
          wreq.set_batch_loss_tokens(totals->loss_tokens);
          wreq.set_batch_samples(totals->samples);
        }
        wreq.set_max_tokens_per_microbatch(req.max_tokens_per_microbatch());
        *wreq.mutable_mesh() = mesh;
        StampMesh(wreq.mutable_mesh());
        wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max());
        return w->TrainStep(wreq, BatchShard{&datums, &ShardOfRank(shards, rank), deadline});
      }));
  LORASTEP_ASSIGN_OR_RETURN(resp, MergeSteps(*run, std::move(per_rank)));
  AddClientMetrics(req.client_metrics(), &resp);
  run->current_fingerprint = fingerprint.Get();
  CommitStep(*run, "TrainStep", "train_step", req.request_id(), &resp);
  return resp;
}

absl::Status Coordinator::CheckNotAutosave(const std::string& run_id, const std::string& name, const char* field) const {
  if (options_.journal == nullptr || !IsAutosaveName(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", AutosaveRef(run_id, name),
                                                 " is a name the journal keeps for the run's autosaves; use another"));
}

absl::StatusOr<v1::SaveStateResponse> Coordinator::SaveState(const v1::SaveStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(CheckNotAutosave(req.run_id(), OwnRefName(req.run_id(), req.path()), "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  // Every rank takes part (tensor ranks gather their slices); rank 0 writes one
  // layout-independent checkpoint, the same as at world size 1.
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::WorkerPathResponse>(*run, AllRanks(*run), [&](int, WorkerClient* w) {
        v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
        StampMesh(wreq.mutable_mesh());
        return w->SaveState(wreq);
      }));
  v1::SaveStateResponse resp;
  resp.set_path(req.path());
  resp.set_learner_version(per_rank[0].learner_version());
  return resp;
}

absl::StatusOr<v1::Run> Coordinator::LoadState(const v1::LoadStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::Run resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "LoadState", req.request_id(), req.sequence_id(), req, &resp));
  if (replayed) return resp;
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), false);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::WorkerPathResponse>(*run, AllRanks(*run), [&](int, WorkerClient* w) {
        v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
        *wreq.mutable_mesh() = mesh;
        StampMesh(wreq.mutable_mesh());
        return w->LoadState(wreq);
      }));
  {
    std::lock_guard<std::mutex> view(run->view_mu);
    run->run.set_learner_version(per_rank[0].learner_version());
    run->run.set_pending_forward_backward(0);
    run->run.clear_diverged();  // every rank now holds the checkpoint's state
  }
  Record(*run, "LoadState", req.request_id(), run->run);  // bumps next_sequence_id
  resp = run->run;
  MaybeAutosave(*run, /*force=*/true);  // the loaded state is what a restart resumes
  return resp;
}

absl::StatusOr<v1::ExportAdapterResponse> Coordinator::ExportAdapter(
    const v1::ExportAdapterRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(CheckNotAutosave(req.run_id(), OwnRefName(req.run_id(), req.path()), "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::WorkerPathResponse>(*run, AllRanks(*run), [&](int, WorkerClient* w) {
        v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
        StampMesh(wreq.mutable_mesh());
        wreq.set_expand_experts(req.expand_experts());
        return w->ExportAdapter(wreq);
      }));
  v1::ExportAdapterResponse resp;
  resp.set_path(req.path());
  resp.set_adapter_sha256(per_rank[0].adapter_sha256());
  resp.set_learner_version(per_rank[0].learner_version());
  return resp;
}

absl::StatusOr<v1::UploadAdapterResponse> Coordinator::UploadAdapter(const std::string& run_id, const std::string& path,
                                                                     const std::string& adapter_config,
                                                                     const std::string& adapter_model) {
  if (path.empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(CheckNotAutosave(run_id, OwnRefName(run_id, path), "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  std::lock_guard<std::mutex> lock(run->mu);
  // Rank 0 writes the state store (a mesh's ranks share one).
  LORASTEP_ASSIGN_OR_RETURN(auto per_rank, FanOut<v1::WorkerPathResponse>(*run, {0}, [&](int, WorkerClient* w) {
    v1::WorkerStoreAdapterRequest wreq;
    wreq.set_run_id(run_id);
    wreq.set_path(path);
    wreq.set_adapter_config(adapter_config);
    wreq.set_adapter_model(adapter_model);
    StampMesh(wreq.mutable_mesh());
    return w->StoreAdapter(wreq);
  }));
  v1::UploadAdapterResponse resp;
  resp.set_path(path);
  resp.set_bytes(static_cast<int64_t>(adapter_config.size() + adapter_model.size()));
  return resp;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  LORASTEP_ASSIGN_OR_RETURN(auto per_rank, FanOut<v1::ListCheckpointsResponse>(
                                               *run, {0}, [&](int, WorkerClient* w) { return w->ListCheckpoints(req); }));
  return per_rank[0];
}

absl::Status Coordinator::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  LORASTEP_RETURN_IF_ERROR(CheckNotAutosave(req.run_id(), req.name(), "name"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);  // not while a SaveState of this run writes
  return FanOut<bool>(*run, {0}, [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
           LORASTEP_RETURN_IF_ERROR(w->DeleteCheckpoint(req));
           return true;
         }).status();
}

absl::StatusOr<v1::GetStepMetricsResponse> Coordinator::GetStepMetrics(
    const v1::GetStepMetricsRequest& req) {
  if (req.limit() < 0) return absl::InvalidArgumentError("limit: must be >= 0");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->view_mu);
  v1::GetStepMetricsResponse resp;
  for (const auto& r : run->history) {
    if (r.step() < req.since_step()) continue;
    if (req.limit() > 0 && resp.steps_size() >= req.limit()) break;
    *resp.add_steps() = r;
  }
  return resp;
}

absl::StatusOr<int64_t> Coordinator::Watch(const std::string& run_id, int64_t since_step,
                                           Watcher watcher, std::vector<v1::StepRecord>* backlog) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  // run->mu orders this against AppendStep: records before registration are in the
  // backlog, later ones reach the watcher.
  std::lock_guard<std::mutex> lock(run->mu);
  for (const auto& r : run->history) {
    if (r.step() >= since_step) backlog->push_back(r);
  }
  std::lock_guard<std::mutex> wlock(run->watch_mu);
  const int64_t id = run->next_watch_id++;
  run->watchers[id] = std::move(watcher);
  return id;
}

void Coordinator::Unwatch(const std::string& run_id, int64_t watch_id) {
  auto run = FindRun(run_id);
  if (!run.ok()) return;
  std::lock_guard<std::mutex> wlock((*run)->watch_mu);
  (*run)->watchers.erase(watch_id);
}

}  // namespace lorastep
