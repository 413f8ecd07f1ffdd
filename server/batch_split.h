// How a call's batch is split over a mesh's data-parallel replicas, and how the ranks'
// answers become one: log-probs back in request order, metrics merged over the reporting
// ranks (tensor rank 0 of the last stage), replica digests compared per family.
#ifndef LORASTEP_SERVER_BATCH_SPLIT_H_
#define LORASTEP_SERVER_BATCH_SPLIT_H_

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/training/batch.h"
#include "lorastep/v1/trainer.pb.h"
#include "lorastep/v1/worker.pb.h"
#include "server/worker_client.h"

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
  // The prompts [begin, end) of a Sample's `num_prompts` that `rank`'s replica samples: each
  // data-parallel replica a contiguous share, in replica order (the last ones maybe none).
  std::pair<int, int> PromptShareOfRank(int num_prompts, int rank) const;
  // One Sample answer from the ranks' (in rank order): the reporting rank of each replica
  // gives its prompts' samples and its metrics.
  v1::SampleResponse MergeSamples(int num_prompts, std::vector<v1::SampleResponse> per_rank) const;
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

// A call's batch on its way to the run's ranks: parsed and split into the replicas' shards
// (each packed once for all the ranks that share it), or, when the run's one worker takes the
// batch as the client sent it (WorkerClient::TakesBatchAsSent), the client's packed form
// passed on unread in the bytes it came in: the worker parses and checks it, once.
class CallBatch {
 public:
  // Parses the request's datums (INVALID_ARGUMENT naming the field): `datums`, `packed`, or
  // `packed_wire` (the request's packed_datums left in its bytes; null when none), unless
  // `as_sent` and the client's datums are in packed_wire.
  static absl::StatusOr<CallBatch> Read(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                        const v1::PackedDatums& packed, const PackedDatumsWire* packed_wire,
                                        bool as_sent);
  // Whether the coordinator holds the datums (else it passes the client's packed form on).
  bool parsed() const { return as_sent_ == nullptr; }
  const std::vector<Datum>& datums() const { return datums_; }  // parsed() only
  int num_datums() const;
  // Log-prob positions an answer may carry (the targets), for CheckResponseFits.
  int64_t num_targets() const;
  // The replicas' shards (BatchSplit::ShardsByTokens); INVALID_ARGUMENT when too few datums.
  absl::Status Split(const BatchSplit& split);
  // What `rank` gets; after Split.
  BatchShard ShardOfRank(const BatchSplit& split, int rank, std::chrono::system_clock::time_point deadline);
  const std::vector<std::vector<int>>& shards() const { return shards_; }

 private:
  std::vector<Datum> datums_;
  const PackedDatumsWire* as_sent_ = nullptr;
  std::vector<std::vector<int>> shards_;
  std::optional<ShardWireForms> wire_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_BATCH_SPLIT_H_
