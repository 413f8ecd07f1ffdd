// The runs that exist on the coordinator, each with its state (RunState), and the CreateRun
// requests that made them: lookup and ownership, the limits on how many runs exist, and
// reserving a new run's id while its workers build it. Knows nothing of workers or gRPC.
#ifndef LORASTEP_SERVER_RUN_REGISTRY_H_
#define LORASTEP_SERVER_RUN_REGISTRY_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"
#include "lorastep/v1/trainer.pb.h"
#include "server/request_records.h"
#include "server/worker_pool.h"

namespace lorastep {

using StepWatcher = std::function<void(const v1::StepRecord&)>;

// A run's autosaves (with a journal), guarded by RunState::autosave_mu.
struct AutosaveState {
  std::string durable;    // checkpoint name of the last durable autosave ("" if none)
  int64_t next = 1;       // the number of the next autosave-<n>
  bool in_flight = false;  // one is being written in the background (one at a time per run)
  // The last autosave: when it ended and how long it took, in the background from its
  // snapshot until it was durable, written or not (< 0: none yet in this process).
  std::chrono::steady_clock::time_point last_end;
  double last_s = -1;
  bool retired = false;  // restored anew or deleted: a late confirmation changes nothing
};

// One run. `mu` is the run's call lock: a mutating call holds it from its exactly-once check
// to its record, so calls on a run are applied one at a time in sequence-id order; it
// guards everything below but the view, autosave and watcher fields.
struct RunState : std::enable_shared_from_this<RunState> {
  explicit RunState(RecordLimits limits) : records(limits) {}
  bool OnDownWorker() const {
    for (const WorkerRef& w : ranks) {
      if (w->down) return true;
    }
    return false;
  }
  std::vector<int> AllRanks() const {
    std::vector<int> out(ranks.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int>(i);
    return out;
  }

  std::mutex mu;
  // Readers (GetRun, ListRuns, GetStepMetrics, Watch) take only this, so they never wait for
  // a step: it guards `run` and `history`, which writers (holding `mu`) change only while
  // holding it too.
  mutable std::mutex view_mu;
  v1::Run run;
  std::deque<v1::StepRecord> history;
  // Sequence ids of the mutating calls queued or running on the run -> their request_id
  // (Coordinator::ClaimSequence), guarded by view_mu.
  std::map<int64_t, std::string> claimed_sequences;
  std::vector<WorkerRef> ranks;  // rank -> worker (one worker when not on a mesh)
  std::mutex autosave_mu;  // held while a confirmation journals an autosave as durable
  std::condition_variable autosave_cv;  // a background autosave ended
  AutosaveState autosave;
  // A step was committed after the last autosave taken (durable or not), and when a call
  // last changed the run's state: an idle run with such a step is saved.
  bool step_since_autosave = false;
  std::chrono::steady_clock::time_point last_change = std::chrono::steady_clock::now();
  RequestRecords records;
  // The fingerprint of the mutating call in progress (set by its exactly-once check, stored
  // with its record).
  std::string current_fingerprint;
  int64_t next_step = 0;
  // Set when the run was restored from its autosave (restart): appended to a sequence-id
  // error, so a client that sent calls past the autosave learns where the run resumed.
  std::string restored_note;
  std::mutex watch_mu;  // guards watchers; held while calling them (taken after view_mu)
  std::map<int64_t, StepWatcher> watchers;
  int64_t next_watch_id = 1;
};
using RunRef = std::shared_ptr<RunState>;

// Who is calling, as the service's authentication established it.
struct Caller {
  std::string owner;   // empty: no authentication configured
  bool admin = false;  // sees and calls every run (also: no authentication configured)
};

struct RunLimits {
  size_t max_runs = 256;            // --max_runs
  size_t max_runs_per_owner = 64;   // --max_runs_per_key; authenticated callers only
};

// Thread-safety: all methods are thread-safe; mu_ is a leaf lock.
class RunRegistry {
 public:
  RunRegistry(RunLimits limits, PrometheusRegistry* metrics);

  // NOT_FOUND naming run_id unless the run exists.
  absl::StatusOr<RunRef> Find(const std::string& run_id) const;
  // NOT_FOUND unless the run exists and is the caller's (an admin reaches every run); another
  // owner's run is reported exactly like a missing one.
  absl::Status CheckAccess(const std::string& run_id, const Caller& caller) const;
  std::vector<RunRef> All() const;
  std::vector<RunRef> Where(const std::function<bool(const RunState&)>& pick) const;
  bool Contains(const std::string& run_id) const;
  size_t size() const;

  // CreateRun's bookkeeping. A request_id that already made a run gives that run (a retry;
  // INVALID_ARGUMENT when its fingerprint differs); else the new run's id is checked (or
  // chosen as <id_prefix>run-<n>), the limits applied, and the id held until Commit or
  // Release. `placement` numbers the runs, for spreading them over workers.
  struct Reservation {
    RunRef existing;  // set for a retried request: nothing was reserved
    std::string run_id;
    size_t placement = 0;
  };
  absl::StatusOr<Reservation> Reserve(const std::string& request_id, const std::string& fingerprint,
                                      const std::string& owner, const std::string& requested_id,
                                      const std::string& id_prefix);
  void Release(const Reservation& r, const std::string& request_id, const std::string& owner);
  void Commit(const Reservation& r, const std::string& request_id, const std::string& owner,
              const std::string& fingerprint, RunRef run);

  // A run brought back from the journal, made by CreateRun `request_id` (`fingerprint`;
  // empty: a run put back as it was, its request kept).
  void Insert(RunRef run, const std::string& request_id, const std::string& fingerprint);
  // Removes `run` if it is still the one under its id (false: deleted or replaced already);
  // with `forget_request`, its CreateRun request_id too.
  bool Remove(const RunState& run, bool forget_request);

 private:
  // These require mu_.
  void ReleaseLocked(const Reservation& r, const std::string& request_id, const std::string& owner);
  void InsertLocked(RunRef run, const std::string& request_id, const std::string& fingerprint);
  void PublishCount();

  const RunLimits limits_;
  PrometheusRegistry* const metrics_;
  mutable std::mutex mu_;  // guards everything below
  std::map<std::string, RunRef> runs_;
  std::map<std::string, std::pair<std::string, std::string>> create_requests_;  // request_id -> (run_id, fingerprint)
  std::set<std::string> creating_ids_;          // run ids whose workers are building them
  std::set<std::string> creating_requests_;     // their request ids
  std::multiset<std::string> creating_owners_;  // their owners (authenticated callers)
  int64_t next_run_number_ = 1;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_RUN_REGISTRY_H_
