// A worker inside the coordinator's process (lorastep_coordinator --in_process_worker):
// the coordinator's calls run WorkerCalls directly on the calling thread, with no second
// gRPC hop, no serialization and no thread hand-off (docs/PERFORMANCE.md compares both
// deployments). One device, world size 1 only: the ranks of a mesh are
// processes. The price: a worker crash takes the coordinator with it, so the process
// worker, which the coordinator restarts, stays the default.
#ifndef LORASTEP_SERVER_IN_PROCESS_WORKER_CLIENT_H_
#define LORASTEP_SERVER_IN_PROCESS_WORKER_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/worker_client.h"
#include "worker/worker_calls.h"
#include "worker/worker_core.h"

namespace lorastep {

class InProcessWorkerClient final : public WorkerClient {
 public:
  // Loads the base model in this process. INVALID_ARGUMENT for a mesh (sizes.world() > 1).
  static absl::StatusOr<std::unique_ptr<InProcessWorkerClient>> Create(const WorkerOptions& options);

  // What the coordinator logs and matches workers by; not a network address.
  std::string address() const override { return "in-process"; }
  absl::StatusOr<v1::WorkerInfo> Info() override;
  absl::StatusOr<v1::WorkerCreateRunResponse> CreateRun(const v1::WorkerCreateRunRequest& req) override;
  absl::Status DeleteRun(const v1::WorkerDeleteRunRequest& req) override;
  absl::StatusOr<v1::WorkerForwardBackwardResponse> ForwardBackward(const v1::WorkerForwardBackwardRequest& req,
                                                                    const BatchShard& batch) override;
  absl::StatusOr<v1::WorkerForwardBackwardResponse> Forward(const v1::WorkerForwardRequest& req,
                                                            const BatchShard& batch) override;
  absl::StatusOr<v1::WorkerStepResponse> OptimStep(const v1::WorkerOptimStepRequest& req) override;
  absl::StatusOr<v1::WorkerStepResponse> TrainStep(const v1::WorkerTrainStepRequest& req,
                                                   const BatchShard& batch) override;
  absl::StatusOr<v1::WorkerPathResponse> SaveState(const v1::WorkerPathRequest& req) override;
  absl::StatusOr<v1::SampleResponse> Sample(const v1::WorkerSampleRequest& req, CancelToken* cancel) override;
  absl::Status AwaitSaved(const v1::WorkerPathRequest& req) override;
  absl::StatusOr<v1::WorkerPathResponse> LoadState(const v1::WorkerPathRequest& req) override;
  absl::StatusOr<v1::WorkerPathResponse> ExportAdapter(const v1::WorkerPathRequest& req) override;
  absl::StatusOr<v1::WorkerPathResponse> StoreAdapter(const v1::WorkerStoreAdapterRequest& req) override;
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& req) override;
  absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) override;
  // Its trainer validates with the coordinator's limits (and the model's max positions).
  bool ValidatesBatchesAsCoordinator() const override { return true; }
  // Does nothing: a call runs on its caller's thread and cannot be abandoned. The
  // coordinator cancels only the ranks of a mesh whose peer failed, and an in-process
  // worker is never in a mesh.
  void CancelInFlight() override {}

 private:
  explicit InProcessWorkerClient(std::unique_ptr<WorkerCore> core)
      : core_(std::move(core)), calls_(core_.get(), /*metrics=*/nullptr, /*record_calls=*/false) {}

  std::unique_ptr<WorkerCore> core_;
  WorkerCalls calls_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_IN_PROCESS_WORKER_CLIENT_H_
