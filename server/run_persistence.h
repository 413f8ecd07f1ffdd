// Runs that outlive their workers and the coordinator (CoordinatorOptions.journal): every
// applied call is journaled before its response leaves; a run's worker state is saved to
// lorastep://<run>/autosave-<n> after steps (spaced as the options say) and when it is idle,
// written in the background and journaled as durable once rank 0 has it on disk; and runs
// come back from their last durable autosave after a restart of the coordinator, of a worker,
// or of the mesh. Without a journal every method is a no-op but MaybeAutosave's spacing.
//
// Lock order: a run's call lock (RunState::mu), then its autosave_mu, then the registry's
// and the pool's locks. No lock but the run's call lock is held across a worker call.
#ifndef LORASTEP_SERVER_RUN_PERSISTENCE_H_
#define LORASTEP_SERVER_RUN_PERSISTENCE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"
#include "rpc/serial_executor.h"
#include "server/mesh_executor.h"
#include "server/run_journal.h"
#include "server/run_registry.h"
#include "server/worker_pool.h"

namespace lorastep {

struct PersistenceOptions {
  RunJournal* journal = nullptr;  // not owned; null: runs live in memory only
  bool autosave_in_background = true;
  int autosave_every_steps = 1;  // 0: spaced by cost (autosave_max_share)
  double autosave_max_share = 0.1;
  int autosave_every_full_steps = 50;
  std::chrono::milliseconds autosave_when_idle{3000};
  size_t max_step_history = 10000;
  RecordLimits record_limits;
  PrometheusRegistry* metrics = nullptr;
};

class RunPersistence {
 public:
  RunPersistence(PersistenceOptions options, RunRegistry* runs, WorkerPool* pool, MeshExecutor* mesh);
  ~RunPersistence();  // Stop(); then finishes the confirmations queued
  void Start();       // the idle-autosave thread
  void Stop();
  bool journaled() const { return options_.journal != nullptr; }

  // A new run, journaled before its workers build it (a run is never unrecorded).
  absl::Status JournalCreate(const v1::Run& run, const v1::CreateRunRequest& req, const std::string& fingerprint);
  // A run whose creation failed; best effort.
  void JournalCreateFailed(const std::string& run_id);
  // An applied call (with the run's newest step record when `with_step`), before its answer
  // leaves. Requires the run's call lock.
  void JournalCall(RunState& run, const std::string& method, const std::string& request_id,
                   const std::string& response, bool with_step);
  // Saves the run's worker state to a new autosave when due (`force`: now). Requires the
  // run's call lock; the step stands if it fails.
  // Saves the run now and journals the save as durable before returning (a run created from
  // a reference: a restore then loads this copy, never the reference, which can change or go).
  absl::Status SaveDurably(RunState& run);
  void MaybeAutosave(RunState& run, bool force);
  // DeleteRun's part: waits (a while) for the run's background autosave, retires the run
  // (late confirmations change nothing), removes its autosaves (when its workers are up)
  // and its journal.
  absl::Status Forget(RunState& run);
  // Waits until every background autosave started so far is journaled as durable or
  // failed; false after `timeout`.
  bool WaitForAutosaves(std::chrono::milliseconds timeout);
  // INVALID_ARGUMENT naming `field` when a client names one of the journal's autosaves
  // (`path` a lorastep://<run_id>/<name> reference, or a bare checkpoint `name`).
  absl::Status CheckNotAutosavePath(const std::string& run_id, const std::string& path, const char* field) const;
  absl::Status CheckNotAutosaveName(const std::string& run_id, const std::string& name, const char* field) const;

  // At start-up: the journaled runs onto the workers added so far. Returns how many came back.
  absl::StatusOr<int> RestoreRuns();
  // WorkerRecovery: a dead worker's runs onto its replacement; runs on down ranks (and, when
  // a registered mesh is whole again, journaled runs not restored yet); runs of a dead
  // worker at a registering worker's address and journaled runs not restored yet.
  void WorkerRestarted(const PooledWorker* dead, const WorkerRef& onto);
  void MeshBack(bool rejoined);
  void Reattach(const WorkerRef& joined);
  // A run whose ranks disagree (one failed after the commit vote): brought back on its
  // workers from its last durable autosave, replacing `run` in the registry. Requires the
  // run's call lock; returns the restored run's view. Without a journal FAILED_PRECONDITION.
  absl::StatusOr<v1::Run> RestoreInPlace(RunState& run);

 private:
  absl::Status RestoreRun(const JournaledRun& journaled, const WorkerRef& onto);
  void RestoreJournaledRuns(const WorkerRef& onto);
  // Restores runs whose workers died from their autosaves: onto `onto` (null: placed as new
  // runs are). A run that cannot be restored stays as it was (down).
  void RestoreOrphans(const std::vector<RunRef>& orphans, const WorkerRef& onto);
  // Retires `old` (late autosave confirmations change nothing), replaces it by the run its
  // journal brings back onto `onto` (null: placed as new runs are); on failure `old` stays.
  // Requires old's call lock. NOT_FOUND when `old` was deleted meanwhile.
  absl::Status RestoreOne(RunState& old, const WorkerRef& onto);
  // `name` (the state at learner `version`) is the run's durable autosave now; returns the
  // previous one ("" if none). Requires the run's autosave_mu.
  absl::Status Autosave(RunState& run, bool force, bool background);  // MaybeAutosave, SaveDurably
  std::string RecordDurableAutosave(RunState& run, const std::string& name, int64_t version);
  void RemoveAutosave(RunState& run, const std::string& name);  // best effort; "" : nothing
  void DeleteAutosaves(RunState& run, const std::string& keep);  // all but `keep`; best effort
  void IdleAutosaveLoop();

  const PersistenceOptions options_;
  RunRegistry* const runs_;
  WorkerPool* const pool_;
  MeshExecutor* const mesh_;
  std::atomic<int64_t> restore_count_{0};  // makes each restore's request_id unique
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;  // guarded by stop_mu_
  std::thread idle_saver_;
  // Background autosaves awaited and journaled as durable, in the order they started. Last:
  // destroyed first, finishing what is queued while the rest is still here.
  std::atomic<int64_t> autosaves_submitted_{0};
  SerialExecutor confirmations_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_RUN_PERSISTENCE_H_
