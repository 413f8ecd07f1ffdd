// Runs one call on the ranks of a run at once and gives one verdict. On a mesh every call
// holds the mesh-order lock (arrival order), so all ranks see calls in one order; at world
// size 1 a run lives on one worker, whose own lock orders its calls, and nothing is held.
// A failure on any rank fails the whole call, naming the ranks (root causes first), and
// moves the mesh to a new communicator generation. After one rank fails on its own the
// others get `peer_failure_grace` to answer; then their calls are cancelled.
#ifndef LORASTEP_SERVER_MESH_EXECUTOR_H_
#define LORASTEP_SERVER_MESH_EXECUTOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/fair_mutex.h"
#include "lib/parallel/parallel_layout.h"
#include "lorastep/v1/worker.pb.h"
#include "server/worker_pool.h"

namespace lorastep {

class MeshExecutor {
 public:
  MeshExecutor(WorkerPool* pool, std::chrono::seconds peer_failure_grace, bool mesh_by_registration);

  // `call(rank, worker)` for each of `ranks` (indices into `workers`, a run's rank -> worker),
  // concurrently; the responses in the order of `ranks`. A worker known to be down fails the
  // call at once; one whose call fails at the transport is marked down.
  template <typename Resp>
  absl::StatusOr<std::vector<Resp>> FanOut(const std::vector<WorkerRef>& workers, const std::vector<int>& ranks,
                                           const std::function<absl::StatusOr<Resp>(int rank, WorkerClient*)>& call) {
    std::vector<std::optional<Resp>> answers(ranks.size());
    absl::Status status = Run(workers, ranks, [&](size_t i, WorkerClient* w) -> absl::Status {
      absl::StatusOr<Resp> answer = call(ranks[i], w);
      if (!answer.ok()) return answer.status();
      answers[i] = std::move(answer).value();
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    std::vector<Resp> out;
    out.reserve(answers.size());
    for (auto& a : answers) out.push_back(std::move(*a));
    return out;
  }

  // Sets the generation (and, for a mesh joined by registration, where its store is) on a
  // call's header. Only inside a FanOut's call (the generation is guarded by the mesh lock).
  void StampMesh(v1::MeshCall* mesh);

 private:
  absl::Status Run(const std::vector<WorkerRef>& workers, const std::vector<int>& ranks,
                   const std::function<absl::Status(size_t i, WorkerClient*)>& call);
  absl::Status Verdict(const std::vector<WorkerRef>& workers, const std::vector<int>& ranks,
                       std::vector<absl::Status>& results, const std::vector<bool>& cancelled, int root_rank);

  WorkerPool* const pool_;
  const std::chrono::seconds peer_failure_grace_;
  const bool mesh_by_registration_;
  FairMutex mesh_mu_;  // the mesh-order lock: held for the whole of a mesh call (on a mesh only)
  // Random, never reused (NewMeshGeneration); guarded by mesh_mu_; changes on a mesh only.
  int64_t mesh_generation_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_MESH_EXECUTOR_H_
