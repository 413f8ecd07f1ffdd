// The worker's gRPC adapter: checks the worker token, runs the call (WorkerCalls) on an
// executor of the worker's dispatch (never on a gRPC thread; device calls queued by run),
// converts the status in rpc/grpc_status.
#ifndef LORASTEP_WORKER_WORKER_SERVICE_H_
#define LORASTEP_WORKER_WORKER_SERVICE_H_

#include <string>

#include "lorastep/v1/worker.grpc.pb.h"
#include "worker/worker_dispatch.h"

namespace lorastep {

class WorkerService final : public v1::Worker::CallbackService {
 public:
  // `token_sha256`: with --worker_token_file, every call must present the token (the
  // coordinator does); empty: open.
  explicit WorkerService(WorkerDispatch* dispatch, std::string token_sha256 = "");

  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* ctx, const v1::WorkerInfoRequest* req,
                                 v1::WorkerInfo* resp) override;
  grpc::ServerUnaryReactor* CreateRun(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerCreateRunRequest* req,
                                      v1::WorkerCreateRunResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteRun(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerDeleteRunRequest* req,
                                      v1::WorkerDeleteRunResponse* resp) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* ctx,
                                            const v1::WorkerForwardBackwardRequest* req,
                                            v1::WorkerForwardBackwardResponse* resp) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx,
                                    const v1::WorkerForwardRequest* req,
                                    v1::WorkerForwardBackwardResponse* resp) override;
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* ctx, const v1::WorkerSampleRequest* req,
                                   v1::SampleResponse* resp) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerOptimStepRequest* req,
                                      v1::WorkerStepResponse* resp) override;
  grpc::ServerUnaryReactor* TrainStep(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerTrainStepRequest* req,
                                      v1::WorkerStepResponse* resp) override;
  grpc::ServerUnaryReactor* SaveState(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerPathRequest* req,
                                      v1::WorkerPathResponse* resp) override;
  grpc::ServerUnaryReactor* AwaitSaved(grpc::CallbackServerContext* ctx,
                                       const v1::WorkerPathRequest* req,
                                       v1::WorkerPathResponse* resp) override;
  grpc::ServerUnaryReactor* LoadState(grpc::CallbackServerContext* ctx,
                                      const v1::WorkerPathRequest* req,
                                      v1::WorkerPathResponse* resp) override;
  grpc::ServerUnaryReactor* ExportAdapter(grpc::CallbackServerContext* ctx,
                                          const v1::WorkerPathRequest* req,
                                          v1::WorkerPathResponse* resp) override;
  grpc::ServerUnaryReactor* StoreAdapter(grpc::CallbackServerContext* ctx,
                                         const v1::WorkerStoreAdapterRequest* req,
                                         v1::WorkerPathResponse* resp) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx,
                                            const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                             const v1::DeleteCheckpointRequest* req,
                                             v1::DeleteCheckpointResponse* resp) override;

 private:
  // Queues `work` (returning absl::Status) on `run_id`'s queue of the device calls (null: on
  // the files executor) and finishes the call when it has run.
  template <typename Work>
  grpc::ServerUnaryReactor* Defer(grpc::CallbackServerContext* ctx, const std::string* run_id, Work work);

  absl::Status CheckToken(grpc::CallbackServerContext* ctx) const;
  WorkerDispatch* dispatch_;
  WorkerCalls& calls_;
  std::string token_sha256_;
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_SERVICE_H_
