// The coordinator's workers: who they are (registration, a mesh's ranks), which are up, and
// bringing dead ones back. A worker found dead is marked down (new runs skip it, its runs'
// calls fail at once, health turns NOT_SERVING); with a restart function it is started
// again (a mesh: every rank) on the pool's own thread, which then asks WorkerRecovery to
// bring the runs back. Knows nothing of runs or gRPC.
//
// Thread-safety: all methods are thread-safe. mu_ is a leaf lock but for on_serving (called
// under it) and is never held across a worker call.
#ifndef LORASTEP_SERVER_WORKER_POOL_H_
#define LORASTEP_SERVER_WORKER_POOL_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/parallel/parallel_layout.h"
#include "server/worker_client.h"

namespace lorastep {

// A worker as the pool knows it. Runs hold it by reference: a dead worker's client lives
// (down) as long as a run placed on it, so its calls fail as down instead of reaching a
// process that has taken its address since.
struct PooledWorker {
  PooledWorker(std::unique_ptr<WorkerClient> c, std::string instance)
      : client(std::move(c)), instance_id(std::move(instance)) {}
  WorkerClient* operator->() const { return client.get(); }
  const std::unique_ptr<WorkerClient> client;
  const std::string instance_id;  // WorkerInfo.instance_id: which process answered
  std::atomic<bool> down{false};  // set once, under the pool's lock, never cleared
};
using WorkerRef = std::shared_ptr<PooledWorker>;

// A rank handed to a worker that joins the mesh by registration.
struct MeshAssignment {
  int rank = 0;
  ParallelSizes sizes;
  std::string rendezvous;  // host:port
};

using RestartWorkerFn = std::function<absl::StatusOr<std::unique_ptr<WorkerClient>>(const std::string& address)>;
using RestartMeshFn = std::function<absl::StatusOr<std::vector<std::unique_ptr<WorkerClient>>>()>;

struct WorkerPoolOptions {
  ParallelSizes mesh;            // world 1: independent workers; else the mesh's ranks
  int rendezvous_port = 29500;   // of rank 0, for ranks that join by registration
  bool mesh_by_registration = false;
  bool journaled = false;        // runs come back from autosaves (the ranks share one store)
  std::chrono::milliseconds health_interval{2000};  // Ping period; 0: never
  RestartWorkerFn restart_worker;  // see CoordinatorOptions
  RestartMeshFn restart_mesh;
};

// What the pool asks of the coordinator once workers are back; called on the pool's thread.
struct WorkerRecovery {
  // A dead local worker was started again as `onto`: its runs come back onto it.
  std::function<void(const PooledWorker* dead, const WorkerRef& onto)> worker_restarted;
  // Every rank of the mesh is new (restarted), or a mesh joined by registration is whole
  // again (`rejoined`): runs on down ranks come back, with `rejoined` journaled ones too.
  std::function<void(bool rejoined)> mesh_back;
  // A worker registered at an address (journal in use): runs of a dead worker there and
  // journaled runs not restored yet come back onto it.
  std::function<void(const WorkerRef& joined)> reattached;
};

class WorkerPool {
 public:
  explicit WorkerPool(WorkerPoolOptions options);
  ~WorkerPool();  // Stop()
  // Starts the restart thread (when dead workers are restarted, or with a journal) and the
  // health watch. `recovery` runs on the restart thread.
  void Start(WorkerRecovery recovery);
  void Stop();  // joins the threads; waits for a restart in progress

  // Adds a worker (at start-up, a registration, a restart). Every worker serves one model;
  // on a mesh its reported rank and sizes must fit. A worker registering again at its
  // address as the same process is kept as it is.
  absl::Status Add(std::unique_ptr<WorkerClient> worker);
  // The next free rank for a worker at `host` (registration order; rank 0 serves the
  // rendezvous), then ranks of dead workers. FAILED_PRECONDITION without a mesh or when every
  // rank is taken and answering; INVALID_ARGUMENT for an empty host.
  absl::StatusOr<MeshAssignment> AssignRank(const std::string& host);
  // The workers a new or restored run lives on: every rank on a mesh (all up), else the up
  // worker `index` picks round robin. UNAVAILABLE when they are not there.
  absl::StatusOr<std::vector<WorkerRef>> Place(size_t index) const;
  // UNAVAILABLE unless a run can be created now (every rank of a mesh registered and up).
  absl::Status CheckCanCreate() const;

  // The worker's process is gone: marked down (once), and restarted when the pool does.
  void MarkDown(PooledWorker* worker, const absl::Status& why);
  // What happens to a run on a down worker (the end of its calls' UNAVAILABLE message).
  std::string WhatHappensToDownRuns() const;
  // Whether the next mesh call must move every rank to a new generation (a rank was
  // replaced or the mesh restarted); clears it.
  bool TakeRegenerate();
  std::string rendezvous() const;
  void CancelInFlight();  // every worker's call in flight returns CANCELLED

  void OnServingChange(std::function<void(bool)> callback);
  size_t num_registered() const;
  std::string model_path() const;
  int64_t vocab_size() const;
  const ParallelLayout& layout() const { return layout_; }
  bool on_mesh() const { return options_.mesh.world() > 1; }

 private:
  bool RestartsDeadWorkers() const;
  bool Serving() const;        // requires mu_
  void PublishHealth();        // requires mu_
  size_t Registered() const;   // requires mu_
  MeshAssignment AssignmentOf(int rank, const std::string& host);  // requires mu_
  void RestartLoop();
  void RestartWorker(const WorkerRef& dead);
  void RestartMesh();
  void HealthWatchLoop();

  const WorkerPoolOptions options_;
  ParallelLayout layout_;
  WorkerRecovery recovery_;
  mutable std::mutex mu_;  // guards everything below
  std::vector<WorkerRef> workers_;  // rank order on a mesh (null: not registered yet)
  std::function<void(bool)> on_serving_;
  std::string model_path_;
  int64_t vocab_size_ = 0;
  std::string store_id_;  // the state store every rank of a journaled mesh shares
  int next_join_rank_ = 0;
  std::string rendezvous_;         // set when rank 0 joins
  std::set<int> rejoining_ranks_;  // dead ranks handed out again, not registered yet
  bool mesh_rejoined_ = false;     // a mesh joined by registration is whole again
  // A rank was replaced or the mesh restarted: survivors may have half-formed the current
  // generation, so the next mesh call moves every rank to a new one.
  bool regenerate_ = false;
  // Bounded: a worker is queued once per death (MarkDown marks it once); a mesh keeps one.
  std::deque<WorkerRef> restart_queue_;
  std::deque<WorkerRef> reattach_queue_;
  bool stopping_ = false;
  bool started_ = false;
  std::condition_variable cv_;
  std::thread restarter_;
  std::thread health_watch_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_WORKER_POOL_H_
