// The coordinator's core, without gRPC: the public API's calls on runs, applied exactly
// once and in order, validated before any work, fanned out to the workers. Its parts:
//   RunRegistry     (run_registry.h)    the runs, their state and ownership, CreateRun records
//   RequestRecords  (request_records.h) each run's exactly-once records
//   WorkerPool      (worker_pool.h)     membership, health, restarts of dead workers
//   MeshExecutor    (mesh_executor.h)   one call on every rank, one verdict, mesh order
//   BatchSplit      (batch_split.h)     a batch over data-parallel replicas, answers merged
//   RunPersistence  (run_persistence.h) journal, autosaves, runs brought back
// Speaks the API's protobuf messages; workers are reached through WorkerClient.
//
// Exactly once: a mutating call whose request_id was already applied returns the recorded
// response and applies nothing. A new call must carry sequence_id == the run's
// next_sequence_id (else FAILED_PRECONDITION); success advances it by one. A call that fails
// changes nothing (workers guarantee it for their part) and consumes no sequence id.
//
// Thread-safety: all methods are thread-safe. Calls on one run are serialized.
//
// Lock order (a lock may be taken while holding only locks above it):
//   1. RunState::mu            a run's call lock: held for a whole mutating call
//   2. MeshExecutor mesh lock  on a mesh, for the whole of one fan-out
//   3. RunState::autosave_mu   never held across a worker call
//   4. RunRegistry, WorkerPool locks (leaves; the pool's calls on_serving under its own)
//   5. RunState::view_mu, then RunState::watch_mu (readers and watchers; leaves)
// Only the first two are held across a worker call: they order the calls (a run's in
// sequence-id order; a mesh's so every rank sees one order). No gRPC thread waits on either:
// reads and Watch take only the view lock.
#ifndef LORASTEP_SERVER_COORDINATOR_H_
#define LORASTEP_SERVER_COORDINATOR_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/training/batch.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/prometheus_registry.h"
#include "lorastep/v1/trainer.pb.h"
#include "server/batch_split.h"
#include "server/mesh_executor.h"
#include "server/request_records.h"
#include "server/run_journal.h"
#include "server/run_persistence.h"
#include "server/run_registry.h"
#include "server/worker_client.h"
#include "server/worker_pool.h"

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

class Coordinator {
 public:
  using Watcher = StepWatcher;

  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();  // waits for worker restarts in progress, then for autosave confirmations
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
  // micro-batch), so no batch work outlives the call that asked for it. `packed`: the
  // request's packed_datums left in the bytes they came in (then absent from `req`), or null.
  // `cancel`: the client's call (gone, or the server shutting down); the workers' calls are
  // cancelled with it and stop at their next micro-batch, and the run's lock is released.
  using Deadline = std::chrono::system_clock::time_point;
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(const v1::ForwardBackwardRequest& req,
                                                              Deadline deadline = Deadline::max(),
                                                              const PackedDatumsWire* packed = nullptr,
                                                              CancelToken* cancel = nullptr);
  absl::StatusOr<v1::ForwardBackwardResponse> Forward(const v1::ForwardRequest& req, Deadline deadline = Deadline::max(),
                                                      const PackedDatumsWire* packed = nullptr,
                                                      CancelToken* cancel = nullptr);
  absl::StatusOr<v1::StepResponse> OptimStep(const v1::OptimStepRequest& req);
  // One call per sequence id at a time: before a mutating call is queued (on the thread that
  // received it), claims `sequence_id` of the run for `request_id` until the returned claim
  // is destroyed. A call whose sequence id is claimed by another request_id (a call queued
  // or running that will take it, or fail) is FAILED_PRECONDITION at once, naming it; it
  // costs no queue slot and no turn. The same request_id (a retry while the first is still
  // queued) gets an empty claim and waits for the first's answer as before.
  class SequenceClaim {
   public:
    SequenceClaim() = default;
    SequenceClaim(SequenceClaim&& other) noexcept { *this = std::move(other); }
    SequenceClaim& operator=(SequenceClaim&& other) noexcept;
    ~SequenceClaim();

   private:
    void Release();
    friend class Coordinator;
    std::shared_ptr<RunState> run_;
    int64_t sequence_id_ = 0;
    std::string request_id_;
  };
  absl::StatusOr<SequenceClaim> ClaimSequence(const std::string& run_id, int64_t sequence_id,
                                              const std::string& request_id);
  absl::StatusOr<v1::StepResponse> TrainStep(const v1::TrainStepRequest& req, Deadline deadline = Deadline::max(),
                                             const PackedDatumsWire* packed = nullptr, CancelToken* cancel = nullptr);
  // Before a batch call of `run_id` is queued, on the thread that received it: where the
  // run's one worker will take `packed` as sent, copies it to where that worker's call reads
  // it (WorkerClient::StageBatch). Skipped while the run is busy (the copy is then made by the
  // call); `values_needed` as the call will ask (a batch the coordinator reads is not passed on).
  void StageBatch(const std::string& run_id, PackedDatumsWire* packed, bool values_needed);
  absl::StatusOr<v1::SaveStateResponse> SaveState(const v1::SaveStateRequest& req);
  absl::StatusOr<v1::Run> LoadState(const v1::LoadStateRequest& req);
  absl::StatusOr<v1::ExportAdapterResponse> ExportAdapter(const v1::ExportAdapterRequest& req);
  // Completions from the run's current adapter (or, with base_model, the base model on the
  // run's worker), ordered with the run's other calls; the learner version sampled is in the
  // answer. World size 1, or a data-parallel mesh (each replica a share of the prompts).
  // `cancel`: the client's call.
  absl::StatusOr<v1::SampleResponse> Sample(const v1::SampleRequest& req, CancelToken* cancel = nullptr);
  // An outside PEFT adapter's files stored at `path` (a reference of the run) by the run's
  // worker, once they load into the run's LoRA config (worker.proto's StoreAdapter).
  absl::StatusOr<v1::UploadAdapterResponse> UploadAdapter(const std::string& run_id, const std::string& path,
                                                          const std::string& adapter_config,
                                                          const std::string& adapter_model, bool replace = false);
  // The state store of the run's rank 0 (the rank that writes checkpoints and exports).
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& req);
  absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& req);
  absl::StatusOr<v1::GetStepMetricsResponse> GetStepMetrics(const v1::GetStepMetricsRequest& req);

  // Hands the kept records with step >= since_step to `backlog`, then registers `watcher`
  // for the run's new records, atomically: no record is missed or given twice, and none
  // comes before the backlog. Both run with the run's watch lock held (on the caller's
  // thread, and on the thread that made each step); they must not block.
  absl::StatusOr<int64_t> Watch(const std::string& run_id, int64_t since_step, Watcher watcher,
                                const std::function<void(std::vector<v1::StepRecord>)>& backlog);
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
  // Stops watching workers' health and restarting or re-attaching them (shutdown, before the
  // local workers are stopped: their exit is not a death to recover from).
  void StopWorkerUpkeep();

 private:
  // The exactly-once check: true (and `out` filled) when request_id was applied already
  // (the same request, by fingerprint, else INVALID_ARGUMENT); else checks the sequence id.
  // With `defer_fingerprint` a new request's fingerprint is left to the caller
  // (FingerprintTask, overlapped with the workers' call), to set before Record.
  absl::StatusOr<bool> Replay(RunState& run, const std::string& method, const std::string& request_id,
                              int64_t sequence_id, const google::protobuf::Message& request,
                              google::protobuf::Message* out, bool defer_fingerprint = false,
                              const PackedField& packed = {});
  // Records and journals an applied call (with the run's newest step when `with_step`) and
  // advances next_sequence_id.
  void Record(RunState& run, const std::string& method, const std::string& request_id,
              const google::protobuf::Message& response, bool with_step = false);
  // After a successful optimizer step: learner version, history, watchers, record, autosave.
  void CommitStep(RunState& run, const std::string& method, const std::string& kind, const std::string& request_id,
                  v1::StepResponse* resp);
  int64_t AppendStep(RunState& run, const std::string& kind, const v1::StepResponse& step);
  // The batch validated and its denominators; none when the run's only worker validates
  // alone (WorkerValidatesAlone) and the call's own totals are not needed.
  absl::StatusOr<std::optional<BatchTotals>> ValidatedTotals(const RunState& run, const CallBatch& batch,
                                                             const v1::LossConfig& loss, bool own_totals_needed);
  // At world size 1 with a worker that validates as the coordinator (in process, or a
  // process it spawned), its trainer runs the coordinator's checks with the same limits
  // before any work, so validating here as well would only repeat them on the step's path.
  bool WorkerValidatesAlone(const RunState& run) const;
  // Whether a call's batch goes to the run's one worker as the client sent it (CallBatch):
  // that worker takes it so, and the coordinator needs none of its values (`values_needed`:
  // the call's own totals, say).
  bool PassesBatchAsSent(const RunState& run, bool values_needed) const;
  absl::Status CheckNotDiverged(const RunState& run);
  // A step that failed on a rank after the commit vote (DATA_LOSS; the others applied it):
  // the run is marked diverged and, with a journal, restored from its autosave. Returns the
  // error the client gets, saying which. Requires the run's call lock.
  absl::Status AfterCommitFailure(RunState& run, const absl::Status& failed);
  // The ranks' step answers as one; marks the run diverged when its replicas differ.
  v1::StepResponse MergeSteps(RunState& run, std::vector<v1::WorkerStepResponse> per_rank);
  // The mesh header of a call: request id, expected learner version (-1: not checked).
  v1::MeshCall MeshHeader(const RunState& run, const std::string& request_id, bool check_version);
  // A path call (SaveState, LoadState, ExportAdapter) on every rank of `run` (its call lock
  // held): each rank's request carries the run, the path, `mesh` (when given) and the mesh's
  // stamp; `send` adds the call's own fields and sends it. Returns rank 0's answer.
  absl::StatusOr<v1::WorkerPathResponse> PathCallOnEveryRank(
      RunState& run, const std::string& run_id, const std::string& path, const v1::MeshCall* mesh,
      const std::function<absl::StatusOr<v1::WorkerPathResponse>(WorkerClient*, v1::WorkerPathRequest)>& send);
  template <typename Resp>
  absl::StatusOr<std::vector<Resp>> FanOut(RunState& run, const std::vector<int>& ranks,
                                           const std::function<absl::StatusOr<Resp>(int rank, WorkerClient*)>& call) {
    return mesh_.FanOut<Resp>(run.ranks, ranks, call);
  }
  bool on_mesh() const { return options_.mesh.world() > 1; }

  const CoordinatorOptions options_;
  RunRegistry runs_;
  WorkerPool pool_;
  MeshExecutor mesh_;
  const BatchSplit split_;
  RunPersistence persistence_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_COORDINATOR_H_
