// The coordinator's core, without gRPC: run registry, per-run ordering and exactly-once
// (request_id / sequence_id), validation before any work, batch sharding to workers,
// step-metric history and watchers. Speaks the API's protobuf messages; workers are reached
// through WorkerClient.
//
// Exactly once: a mutating call whose request_id was already applied returns the recorded
// response and applies nothing. A new call must carry sequence_id == the run's
// next_sequence_id (else FAILED_PRECONDITION); success advances it by one. A call that fails
// changes nothing (workers guarantee it for their part) and consumes no sequence id.
//
// Thread-safety: all methods are thread-safe. Calls on one run are serialized.
#ifndef LORASTEP_SERVER_COORDINATOR_H_
#define LORASTEP_SERVER_COORDINATOR_H_

#include <deque>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/fair_mutex.h"
#include "lib/training/batch.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/prometheus_registry.h"
#include "lorastep/v1/trainer.pb.h"
#include "rpc/serial_executor.h"
#include "server/run_journal.h"
#include "server/worker_client.h"

namespace lorastep {

struct CoordinatorOptions {
  size_t max_step_history = 10000;       // step records kept per run
  // request_ids remembered per run for retries; each keeps its whole response (log-probs).
  size_t max_recorded_requests = 256;
  // Bytes of recorded responses kept per run (--max_recorded_mb); older bodies are dropped.
  size_t max_recorded_bytes = size_t{64} << 20;
  size_t max_runs = 256;  // CreateRun beyond it is RESOURCE_EXHAUSTED (--max_runs)
  // Runs one API key's owner may hold at once (--max_runs_per_key); authenticated callers only.
  size_t max_runs_per_owner = 64;
  BatchLimits limits;
  // The mesh the workers form (world 1: each worker is on its own and runs are spread over
  // them). With world > 1 the workers are the mesh's ranks, every run lives on all of them,
  // and every call fans out to all ranks in one mesh-wide order.
  ParallelSizes mesh;
  // How long the other ranks of a mesh call may still take after one rank failed on its
  // own (its process died, say) before their calls are cancelled and the client answered.
  // They normally fail at their collective timeout; a rank wedged in a device kernel may
  // never answer. --peer_failure_grace_s; default: the collective timeout + 30 s.
  std::chrono::seconds peer_failure_grace{150};
  // How often every worker that is up is asked whether its process is there (Ping): one
  // that is gone (UNAVAILABLE twice in a row) is marked down without waiting for a call, so
  // health turns NOT_SERVING and its restart (or the wait for it) begins. 0: never.
  std::chrono::milliseconds worker_health_interval{2000};
  // Where per-run step figures are recorded for the Prometheus endpoint (not owned; none:
  // not recorded). See docs/OPERATIONS.md for the metric names.
  PrometheusRegistry* metrics = nullptr;
  // Port of the rendezvous store that rank 0 serves when workers join by registration (JoinMesh).
  int rendezvous_port = 29500;
  // The mesh's ranks join by registration (--wait_for_workers with --tp/--pp/--dp): a rank
  // that died is handed out again to the next worker that asks, and with a journal the runs
  // come back from their autosaves once every rank is up again.
  bool mesh_by_registration = false;
  // Runs survive a restart of the coordinator (server/run_journal.h): every applied call is
  // journaled before its response leaves, and the workers' state of a run is saved to
  // lorastep://<run>/autosave-<n> (the workers need --state_dir) after every
  // `autosave_every_steps` optimizer steps and after each LoadState. Not owned; null: runs
  // live in memory only.
  RunJournal* journal = nullptr;
  // The workers copy the state to host memory on the call's path and write it afterwards;
  // the journal marks the autosave durable once rank 0 says it is written. false: the call
  // waits for the disk (and a step during a background write skips its autosave).
  bool autosave_in_background = true;
  // 0: spaced by cost instead: after a step once the run's wall time since its last autosave
  // is at least that autosave's duration / `autosave_max_share` (the first step always), so
  // autosaves take at most that share of a run's time: one that takes d seconds comes at most
  // every d / share seconds (every step when steps are longer than that). A background
  // autosave's duration runs from its snapshot until it is durable: the disk's time counts.
  int autosave_every_steps = 1;
  double autosave_max_share = 0.1;
  // The same for full fine-tuning runs (rank 0), whose state is the whole model and its
  // optimizer: saved far less often by default (--autosave_every_full_steps).
  int autosave_every_full_steps = 50;
  // A run whose last step was not autosaved (the spacing did not allow it) is saved once no
  // call has changed it for this long (no ForwardBackward pending): while idle an autosave
  // costs the run nothing, and a restart then resumes at its last step. 0: never.
  std::chrono::milliseconds autosave_when_idle{3000};
  // Brings back the dead worker at `address` and returns a client of it: a local worker is
  // started again; a listed one (--workers) is awaited at its address (its supervisor
  // restarts it; UNAVAILABLE while nothing answers there, and the restart is tried again).
  // With a journal and no mesh, a worker found dead is brought back this way and its runs are
  // restored from their autosaves onto it. Unset: a dead worker stays down (runs on it fail
  // until it is replaced by registration).
  std::function<absl::StatusOr<std::unique_ptr<WorkerClient>>(const std::string& address)> restart_worker;
  // The same for a mesh: local ranks are all stopped and started again at a fresh rendezvous;
  // listed ones (--workers) are awaited until a process answers at every address
  // (UNAVAILABLE meanwhile, and it is tried again). Returns clients of every rank in rank
  // order. With a journal, a rank found dead brings the whole mesh back this way: every rank
  // forms a new generation of communicators (a replacement joins the survivors there) and
  // every run is restored from its autosave. Unset: the mesh stays down.
  std::function<absl::StatusOr<std::vector<std::unique_ptr<WorkerClient>>>()> restart_mesh;
};

// Who is calling, as the service's authentication established it.
struct Caller {
  std::string owner;   // empty: no authentication configured
  bool admin = false;  // sees and calls every run (also: no authentication configured)
};

// A rank handed to a worker that joins the mesh by registration.
struct MeshAssignment {
  int rank = 0;
  ParallelSizes sizes;
  std::string rendezvous;  // host:port
};

class Coordinator {
 public:
  using Watcher = std::function<void(const v1::StepRecord&)>;

  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();  // waits for worker restarts in progress
  // Adds a worker (at start-up, or when a remote worker registers). Reads its model and
  // vocabulary; every worker must serve the same model. New runs are spread over workers.
  // On a mesh the worker's reported rank and sizes must fit `options.mesh`.
  absl::Status AddWorker(std::unique_ptr<WorkerClient> worker);
  // Called with the coordinator's serving state now and whenever it changes (the gRPC
  // health service's status).
  void OnServingChange(std::function<void(bool)> callback);
  size_t num_workers();
  // Gives the next free rank of the mesh to a worker at `host` (registration order; the
  // first is rank 0 and serves the rendezvous). FAILED_PRECONDITION when this coordinator
  // runs no mesh or every rank is taken; INVALID_ARGUMENT for an empty host.
  absl::StatusOr<MeshAssignment> AssignRank(const std::string& host);

  // `owner`: the caller's identity (its API key's owner; empty without authentication).
  // `id_prefix`: put before the run id the client chose or the one assigned (the owner's
  // namespace, server/run_names.h); ids are otherwise checked and kept as they are.
  absl::StatusOr<v1::Run> CreateRun(const v1::CreateRunRequest& req, const std::string& owner = "",
                                    const std::string& id_prefix = "");
  // NOT_FOUND unless the run exists and is the caller's (an admin reaches every run).
  absl::Status CheckAccess(const std::string& run_id, const Caller& caller);
  absl::StatusOr<v1::Run> GetRun(const std::string& run_id);
  // Waits for the run's call in flight, frees it on every rank, forgets it.
  absl::Status DeleteRun(const std::string& run_id);
  std::vector<v1::Run> ListRuns();
  // `deadline`: the client's; the workers' calls end then too (a worker stops at its next
  // micro-batch), so no batch work outlives the call that asked for it.
  using Deadline = std::chrono::system_clock::time_point;
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(const v1::ForwardBackwardRequest& req,
                                                              Deadline deadline = Deadline::max());
  absl::StatusOr<v1::ForwardBackwardResponse> Forward(const v1::ForwardRequest& req, Deadline deadline = Deadline::max());
  absl::StatusOr<v1::StepResponse> OptimStep(const v1::OptimStepRequest& req);
  absl::StatusOr<v1::StepResponse> TrainStep(const v1::TrainStepRequest& req, Deadline deadline = Deadline::max());
  absl::StatusOr<v1::SaveStateResponse> SaveState(const v1::SaveStateRequest& req);
  absl::StatusOr<v1::Run> LoadState(const v1::LoadStateRequest& req);
  absl::StatusOr<v1::ExportAdapterResponse> ExportAdapter(const v1::ExportAdapterRequest& req);
  // An outside PEFT adapter's files stored at `path` (a reference of the run) by the run's
  // worker, once they load into the run's LoRA config (worker.proto's StoreAdapter).
  absl::StatusOr<v1::UploadAdapterResponse> UploadAdapter(const std::string& run_id, const std::string& path,
                                                          const std::string& adapter_config,
                                                          const std::string& adapter_model);
  // The state store of the run's rank 0 (the rank that writes checkpoints and exports).
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& req);
  absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& req);
  absl::StatusOr<v1::GetStepMetricsResponse> GetStepMetrics(const v1::GetStepMetricsRequest& req);

  // Registers `watcher` for new step records of a run and returns the kept records with
  // step >= since_step in `backlog` (atomically: no record is missed or sent twice).
  // The watcher runs on the thread that made the step; it must not block.
  absl::StatusOr<int64_t> Watch(const std::string& run_id, int64_t since_step, Watcher watcher,
                                std::vector<v1::StepRecord>* backlog);
  // After Unwatch returns, the watcher is not running and is never called again.
  void Unwatch(const std::string& run_id, int64_t watch_id);

  std::string model_path();

  // Brings back the journaled runs (options.journal) on the workers added so far, each as of
  // its last autosave; call once, after AddWorker and before serving. A run that cannot be
  // brought back is skipped with a log line and stays in the journal for the next start.
  // Returns how many runs came back.
  absl::StatusOr<int> RestoreRuns();
  // Waits (up to `timeout`) until every background autosave started so far is journaled as
  // durable or failed; false on timeout. Before shutting the workers down.
  bool WaitForAutosaves(std::chrono::milliseconds timeout);
  // Makes every worker call in flight return CANCELLED now (shutdown: the calls' clients are
  // gone, and a worker stops a cancelled batch call at its next micro-batch).
  void CancelWorkerCalls();

 private:
  struct RunState;
  absl::StatusOr<std::shared_ptr<RunState>> FindRun(const std::string& run_id);
  // Looks up a recorded response (returns true and fills `out`), or checks the sequence id.
  // A recorded request_id must come with the same request (fingerprint), else
  // INVALID_ARGUMENT. With `defer_fingerprint` a new request's fingerprint is left to the
  // caller (FingerprintTask, overlapped with the workers' call), to set before Record.
  absl::StatusOr<bool> Replay(RunState& run, const std::string& method,
                              const std::string& request_id, int64_t sequence_id,
                              const google::protobuf::Message& request,
                              google::protobuf::Message* out, bool defer_fingerprint = false);
  // Also journals the call (with the run's newest step record when `with_step`).
  void Record(RunState& run, const std::string& method, const std::string& request_id,
              const google::protobuf::Message& response, bool with_step = false);
  // With a journal: saves the run's worker state to its autosave and marks the journal,
  // when `force` or when the learner version is a multiple of autosave_every_steps (0: when
  // the time since the last autosave allows, see CoordinatorOptions).
  void MaybeAutosave(RunState& run, bool force);
  // `name` (of the state at learner `version`) is the run's durable autosave now. Returns
  // the previous one ("" if none), for RemoveAutosave. Requires the run's autosave_mu.
  std::string RecordDurableAutosave(RunState& run, const std::string& name, int64_t version);
  // Removes an autosave folder on rank 0 ("": nothing); best effort, not under autosave_mu.
  void RemoveAutosave(RunState& run, const std::string& name);
  // Removes the run's autosave folders (on rank 0's store) but `keep`; best effort.
  void DeleteAutosaves(RunState& run, const std::string& keep);
  // INVALID_ARGUMENT naming `field` when a client names one of the journal's autosaves.
  absl::Status CheckNotAutosave(const std::string& run_id, const std::string& name, const char* field) const;
  // Record's bounded store of request records (also used when restoring a run).
  void KeepRecord(RunState& run, const std::string& request_id, const std::string& method,
                  const std::string& response, const std::string& fingerprint);
  absl::Status RestoreRun(const JournaledRun& journaled, WorkerClient* onto = nullptr);
  // The workers a new or restored run lives on: every rank on a mesh (all must be up), else
  // the next worker that is up, round robin. Requires mu_.
  absl::StatusOr<std::vector<WorkerClient*>> PlaceRun() const;
  int64_t AppendStep(RunState& run, const std::string& kind, const v1::StepResponse& step);
  // After a successful optimizer step: learner version, history, watchers, exactly-once record.
  void CommitStep(RunState& run, const std::string& method, const std::string& kind,
                  const std::string& request_id, v1::StepResponse* resp);
  // Validates loss and datums; the batch-wide loss denominators.
  // The batch validated and its denominators; none when the run's only worker validates
  // alone (WorkerValidatesAlone) and the call's own totals are not needed.
  absl::StatusOr<std::optional<BatchTotals>> ValidatedTotals(const RunState& run, const std::vector<Datum>& datums,
                                                             const v1::LossConfig& loss, bool own_totals_needed);
  // At world size 1 with an in-process worker, its trainer runs the coordinator's checks with
  // the same limits before any work: validating here as well cost ~0.15 ms of each step on
  // the H200 host (issue 9).
  bool WorkerValidatesAlone(const RunState& run) const;

  int64_t vocab_size();
  bool on_mesh() const { return options_.mesh.world() > 1; }

  // Runs `call` on each of `ranks` of `run` concurrently, under the mesh lock on a mesh (one
  // call at a time, so all ranks see calls in one order; at world size 1 no lock). Any failure fails the whole
  // call, naming the ranks, and makes the next call rebuild communicators.
  template <typename Resp>
  absl::StatusOr<std::vector<Resp>> FanOut(
      RunState& run, const std::vector<int>& ranks,
      const std::function<absl::StatusOr<Resp>(int rank, WorkerClient*)>& call);
  std::vector<int> AllRanks(const RunState& run) const;
  size_t RegisteredWorkers() const;  // requires mu_; mesh slots may still be empty
  // The data-parallel shard (indices into the request's datums) that `rank` trains on.
  const std::vector<int>& ShardOfRank(const std::vector<std::vector<int>>& shards, int rank) const;
  // The mesh header of a call: request id, expected learner version, generation.
  v1::MeshCall MeshHeader(const RunState& run, const std::string& request_id, bool check_version);
  // Sets the generation (and, for a mesh joined by registration, where its store is) on
  // a call's header. Requires mesh_mu_ (FanOut's calls run under it).
  void StampMesh(v1::MeshCall* mesh);
  // Datums of each data-parallel replica, balanced by token count (in request order).
  std::vector<std::vector<int>> ShardsByTokens(const std::vector<Datum>& datums);
  absl::Status CheckShardable(int num_datums);
  // Compares the replica digests of every family after a step; fills the response.
  void CheckReplicas(RunState& run, const std::vector<v1::WorkerStepResponse>& per_rank,
                     v1::StepResponse* resp);
  absl::StatusOr<v1::StepResponse> MergeSteps(RunState& run, std::vector<v1::WorkerStepResponse> per_rank);
  v1::ForwardBackwardResponse MergeForward(const std::vector<std::vector<int>>& shards, int num_datums,
                                           const std::vector<v1::WorkerForwardBackwardResponse>& per_rank);
  absl::Status CheckNotDiverged(const RunState& run);

  CoordinatorOptions options_;
  ParallelLayout layout_;
  FairMutex mesh_mu_;            // held for the whole of a mesh call (on a mesh only); arrival order
  // Guarded by mesh_mu_ (NewMeshGeneration: random, never reused); changes on a mesh only.
  int64_t mesh_generation_;

  // A worker whose process is gone (a call failed at the transport, not in a collective):
  // new runs skip it, its runs' calls say so, health turns NOT_SERVING when no worker (on a
  // mesh: not every rank) is up. A worker registering at a down one's address replaces it.
  void MarkDown(WorkerClient* worker, const absl::Status& why);
  void PublishHealth();  // under mu_
  bool Serving() const;  // under mu_

  std::mutex mu_;  // guards everything below
  std::vector<std::unique_ptr<WorkerClient>> workers_;
  std::set<const WorkerClient*> down_;
  std::vector<std::unique_ptr<WorkerClient>> replaced_;  // down workers a new one replaced (runs point at them)
  std::function<void(bool)> on_serving_;
  std::string model_path_;
  int64_t vocab_size_ = 0;
  std::string mesh_store_id_;  // the state store every rank of a journaled mesh shares
  std::map<std::string, std::shared_ptr<RunState>> runs_;
  // request_id -> (run_id, request fingerprint)
  std::map<std::string, std::pair<std::string, std::string>> create_requests_;
  std::set<std::string> creating_ids_;       // run ids whose worker-side creation is in flight
  std::set<std::string> creating_requests_;  // their request ids
  std::multiset<std::string> creating_owners_;  // their owners (authenticated callers)
  int64_t next_run_number_ = 1;
  MeshAssignment AssignmentOf(int rank, const std::string& host);  // requires mu_
  int next_join_rank_ = 0;      // guarded by mu_
  std::string rendezvous_;      // set when rank 0 joins; guarded by mu_
  std::set<int> rejoining_ranks_;  // dead ranks handed out again, not registered yet; guarded by mu_
  bool mesh_rejoined_ = false;     // a mesh joined by registration is whole again; guarded by mu_
  // A dead rank's slot was taken by a new worker, or the mesh was restarted: the next mesh
  // call moves every rank to a new generation (survivors may have half-formed the current
  // one). Guarded by mu_.
  bool mesh_regenerate_ = false;
  // Restarts of dead local workers and the restores of their runs (RestartWorker), on one
  // long-lived thread: a worker dies with the thread that started it (PR_SET_PDEATHSIG).
  void RestartWorker(WorkerClient* dead);
  void RestartMesh();
  // Restores runs whose workers were replaced from their autosaves: onto `onto` (the dead
  // worker's replacement, which holds its state store), or any worker up when null.
  void RestoreOrphans(const std::vector<std::shared_ptr<RunState>>& orphans, WorkerClient* onto = nullptr);
  void RestartLoop();
  // A mesh joined by registration is whole again (its first forming, a rank that registered
  // in a dead one's place, or a restarted coordinator's workers registering again): every
  // rank forms a new generation, runs with a replaced rank and journaled runs not restored
  // yet come back from their autosaves.
  void RejoinMesh();
  // Journaled runs not restored yet, onto `onto` (null: placed as new runs are).
  void RestoreJournaledRuns(WorkerClient* onto);
  // A worker that registered (or registered again) with a journal in use: restores onto it
  // the runs of a dead worker at its address and journaled runs not restored yet.
  void Reattach(WorkerClient* joined);
  // Whether a dead worker (a mesh: every rank) is brought back by this coordinator
  // (restart_worker / restart_mesh, with a journal) rather than awaited by registration.
  bool RestartsDeadWorkers() const;
  // The end of an UNAVAILABLE message for a run on a dead worker: what will happen to it.
  std::string WhatHappensToDownRuns() const;
  // Saves runs idle for autosave_when_idle with an unsaved last step (with a journal).
  void IdleAutosaveLoop();
  std::thread idle_saver_;
  // Pings the workers that are up every worker_health_interval (see CoordinatorOptions).
  void HealthWatchLoop();
  std::thread health_watch_;
  std::thread restarter_;
  std::deque<WorkerClient*> restart_queue_;  // guarded by mu_
  std::deque<WorkerClient*> reattach_queue_;  // guarded by mu_
  std::atomic<int64_t> restore_count_{0};      // makes each restore's request_id unique
  std::map<const WorkerClient*, std::string> instances_;  // WorkerInfo.instance_id; guarded by mu_
  std::condition_variable restart_cv_;
  bool stopping_ = false;                    // guarded by mu_
  // Background autosaves awaited and journaled as durable, in the order they started. Last:
  // destroyed first, finishing what is queued while the rest is still here.
  std::atomic<int64_t> autosaves_submitted_{0};
  SerialExecutor autosave_confirmations_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_COORDINATOR_H_
