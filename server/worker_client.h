// How the coordinator talks to one worker. The coordinator core depends on this interface
// only; GrpcWorkerClient (grpc_worker_client.h) is the real one. Calls block: the
// coordinator makes them from its own executor threads, never from gRPC threads.
#ifndef LORASTEP_SERVER_WORKER_CLIENT_H_
#define LORASTEP_SERVER_WORKER_CLIENT_H_

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/cancel_token.h"
#include "lib/training/batch.h"
#include "rpc/packed_wire.h"
#include "lorastep/v1/worker.pb.h"

namespace lorastep {

// The wire form of a call's shards (the datums as a worker request carries them), each built
// once by the first rank that sends it and copied into the requests of the others that
// train on the same shard (the tensor and pipeline ranks of one data-parallel replica).
// Thread-safe.
class ShardWireForms {
 public:
  struct Form {
    google::protobuf::RepeatedPtrField<v1::Datum> datums;
    v1::PackedDatums packed;
  };
  explicit ShardWireForms(size_t shards) : once_(shards), forms_(shards) {}
  const Form& Get(size_t shard, const std::function<void(Form*)>& build) {
    std::call_once(once_[shard], [&] { build(&forms_[shard]); });
    return forms_[shard];
  }

 private:
  std::vector<std::once_flag> once_;
  std::vector<Form> forms_;
};

// A call's share of a batch the coordinator has parsed and validated: datums[i] for i in
// indices, in that order. A worker process gets it packed into the request (once per shard
// when `wire` is given); an in-process worker gets the datums themselves (no packing and
// parsing again). Or, for a worker that TakesBatchAsSent and has the whole batch, `as_sent`:
// the client's packed batch, passed on in the bytes it came in. Empty (both null): the request carries
// its datums.
struct BatchShard {
  const std::vector<Datum>* datums = nullptr;
  const std::vector<int>* indices = nullptr;
  // The client's deadline: the worker's call ends then too, and the worker stops at its next
  // micro-batch (max: only the client's worker-call timeout applies).
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  // The client's call: cancelled when the client goes away (or the server shuts down); the
  // worker's call is cancelled then and stops at its next micro-batch. Null: never.
  CancelToken* cancel = nullptr;
  ShardWireForms* wire = nullptr;  // shared by the call's ranks; null: packed per rank
  size_t shard = 0;                // which of wire's shards this is
  const PackedDatumsWire* as_sent = nullptr;  // instead of datums: unparsed, unchecked
};

class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  virtual std::string address() const = 0;
  virtual absl::StatusOr<v1::WorkerInfo> Info() = 0;
  // Whether the worker answers within `timeout` (UNAVAILABLE: its process is gone).
  virtual absl::Status Ping(std::chrono::seconds timeout) { return Info().status(); }
  virtual absl::StatusOr<v1::WorkerCreateRunResponse> CreateRun(const v1::WorkerCreateRunRequest& req) = 0;
  virtual absl::Status DeleteRun(const v1::WorkerDeleteRunRequest& req) = 0;
  virtual absl::StatusOr<v1::WorkerForwardBackwardResponse> ForwardBackward(
      const v1::WorkerForwardBackwardRequest& req, const BatchShard& batch) = 0;
  virtual absl::StatusOr<v1::WorkerForwardBackwardResponse> Forward(const v1::WorkerForwardRequest& req,
                                                                     const BatchShard& batch) = 0;
  virtual absl::StatusOr<v1::WorkerStepResponse> OptimStep(const v1::WorkerOptimStepRequest& req) = 0;
  virtual absl::StatusOr<v1::WorkerStepResponse> TrainStep(const v1::WorkerTrainStepRequest& req,
                                                           const BatchShard& batch) = 0;
  virtual absl::StatusOr<v1::WorkerPathResponse> SaveState(const v1::WorkerPathRequest& req) = 0;
  // Until a background SaveState of req.path is written (worker.proto's AwaitSaved).
  virtual absl::Status AwaitSaved(const v1::WorkerPathRequest& req) = 0;
  virtual absl::StatusOr<v1::WorkerPathResponse> LoadState(const v1::WorkerPathRequest& req) = 0;
  virtual absl::StatusOr<v1::WorkerPathResponse> ExportAdapter(const v1::WorkerPathRequest& req) = 0;
  virtual absl::StatusOr<v1::WorkerPathResponse> StoreAdapter(const v1::WorkerStoreAdapterRequest& req) = 0;
  virtual absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& req) = 0;
  virtual absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) = 0;
  // Completions from the run's adapter or the base model; `cancel` (may be null) ends the
  // call when the client's call is cancelled.
  virtual absl::StatusOr<v1::SampleResponse> Sample(const v1::WorkerSampleRequest& req, CancelToken* cancel) = 0;
  // True when the worker checks a batch with this coordinator's own limits before any work
  // and returns the same errors (an in-process worker, or a worker process the coordinator
  // spawned): alone on a run, it validates alone.
  virtual bool ValidatesBatchesAsCoordinator() const { return false; }
  // True when a batch this worker gets whole is best passed on as the client packed it
  // (BatchShard::as_sent): a worker process parses its request anyway, so the coordinator
  // parsing and packing it again would only repeat the work. Implies
  // ValidatesBatchesAsCoordinator.
  virtual bool TakesBatchAsSent() const { return false; }
  // Copies a batch it will take as sent to where its call reads it, ahead of the call, on the
  // thread that has the bytes at hand (the pipe's shared region: PackedDatumsWire::staged);
  // the call copies only its own few bytes then. Nothing where there is no such place.
  virtual void StageBatch(PackedDatumsWire* batch) {}
  // Makes every call in flight on this client return CANCELLED now (the coordinator gives
  // up on a rank that does not answer after a peer failed).
  virtual void CancelInFlight() = 0;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_WORKER_CLIENT_H_
