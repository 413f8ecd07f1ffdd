// WorkerClient over gRPC (a channel to one lorastep_worker).
#ifndef LORASTEP_SERVER_GRPC_WORKER_CLIENT_H_
#define LORASTEP_SERVER_GRPC_WORKER_CLIENT_H_

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/call_pipe.h"
#include "server/worker_client.h"

namespace lorastep {

// TLS toward workers: the CA that signed their certificates, and (mutual TLS) the
// coordinator's own certificate and key. All PEM; an empty CA: plaintext.
struct WorkerTls {
  std::string ca_pem;
  std::string client_cert_pem, client_key_pem;
};

class GrpcWorkerClient final : public WorkerClient {
 public:
  // Every call carries a deadline of `call_timeout` (a training step on a large batch takes
  // minutes; a worker that hangs must not hold the mesh forever).
  // `worker_token`: sent as "authorization: Bearer <token>" to workers started with
  // --worker_token_file (empty: none). `tls`: workers serve TLS (see WorkerTls).
  // `call_pipe_fd`: this side of the call pipe of a worker this coordinator spawned
  // (ChildServer::TakePipeFd; owned from here on): the per-step calls (TrainStep,
  // ForwardBackward, Forward, OptimStep) go over it instead of gRPC. -1: none.
  // `spawned`: a worker this coordinator started from its own build and model (ChildServer):
  // its trainer checks a batch with the coordinator's limits and vocabulary, so it validates
  // alone and takes whole batches as the client sent them.
  explicit GrpcWorkerClient(const std::string& address,
                            std::chrono::seconds call_timeout = std::chrono::seconds(3600),
                            std::string worker_token = "", const WorkerTls& tls = {}, int call_pipe_fd = -1,
                            bool spawned = false);
  // Waits until the channel is ready (or the deadline passes).
  absl::Status WaitReady(int timeout_seconds);
  // With a call pipe: its waiting callers poll for answers near their expected time
  // (CallPipeClient::set_poll_for_answers).
  void set_poll_pipe_answers(bool on) {
    if (pipe_ != nullptr) pipe_->set_poll_for_answers(on);
  }

  std::string address() const override { return address_; }
  absl::StatusOr<v1::WorkerInfo> Info() override;
  absl::Status Ping(std::chrono::seconds timeout) override;
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
  bool ValidatesBatchesAsCoordinator() const override { return spawned_; }
  bool TakesBatchAsSent() const override { return spawned_; }
  void StageBatch(PackedDatumsWire* batch) override;
  void CancelInFlight() override;

 private:
  // One unary call with the deadline, registered so CancelInFlight can reach it.
  template <typename Resp, typename Req, typename Method>
  // `timeout` 0: the client's call timeout; the call ends at `deadline` if that comes first,
  // or when `cancel` is cancelled.
  absl::StatusOr<Resp> Call(Method method, const Req& req, std::chrono::seconds timeout = std::chrono::seconds(0),
                            std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max(),
                            CancelToken* cancel = nullptr);

  // A per-step call with the shard's datums (none: BatchShard{}), ending at its deadline: over
  // the call pipe when there is one, else as Call does.
  template <typename Resp, typename Req, typename Method>
  absl::StatusOr<Resp> StepCall(Method method, WorkerPipeMethod pipe_method, const Req& req, const BatchShard& batch);

  std::string address_;
  std::chrono::seconds call_timeout_;
  const bool spawned_;
  std::unique_ptr<CallPipeClient> pipe_;
  std::string authorization_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  std::mutex in_flight_mu_;
  std::set<grpc::ClientContext*> in_flight_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_GRPC_WORKER_CLIENT_H_
