// How a call's batch is split over a mesh's data-parallel replicas, and how the ranks'
// answers become one: log-probs back in request order, metrics merged over the reporting
// ranks (tensor rank 0 of the last stage), replica digests compared per family.
#ifndef LORASTEP_SERVER_BATCH_SPLIT_H_
#define LORASTEP_SERVER_BATCH_SPLIT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/training/batch.h"
#include "lorastep/v1/trainer.pb.h"
#include "lorastep/v1/worker.pb.h"

namespace lorastep {

class BatchSplit {
 public:
  // `layout`: the mesh (world 1: one worker takes the whole batch).
  explicit BatchSplit(const ParallelLayout& layout) : layout_(layout) {}

  // INVALID_ARGUMENT naming datums when there are fewer than data-parallel replicas.
  absl::Status CheckShardable(int num_datums) const;
  // Datums of each replica (indices into the request's), balanced by token count, each in
  // request order.
  std::vector<std::vector<int>> ShardsByTokens(const std::vector<Datum>& datums) const;
  // The shard that `rank` trains on, and its index.
  const std::vector<int>& ShardOfRank(const std::vector<std::vector<int>>& shards, int rank) const;
  size_t ShardIndexOfRank(int rank) const { return on_mesh() ? layout_.Coords(rank).dp : 0; }
  v1::ForwardBackwardResponse MergeForward(const std::vector<std::vector<int>>& shards, int num_datums,
                                           const std::vector<v1::WorkerForwardBackwardResponse>& per_rank) const;
  // One step answer with the replica hashes filled in; `diverged` names the families whose
  // replicas differ ("" when all agree).
  v1::StepResponse MergeSteps(std::vector<v1::WorkerStepResponse> per_rank, std::string* diverged) const;

 private:
  bool on_mesh() const { return layout_.world_size() > 1; }
  bool Reports(int rank) const;
  void CompareReplicas(const std::vector<v1::WorkerStepResponse>& per_rank, v1::StepResponse* resp,
                       std::string* diverged) const;

  const ParallelLayout layout_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_BATCH_SPLIT_H_
