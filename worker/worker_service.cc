#include "worker/worker_service.h"

#include "rpc/bearer_token.h"
#include "rpc/grpc_status.h"
#include "rpc/serial_executor.h"

namespace lorastep {

WorkerService::WorkerService(WorkerDispatch* dispatch, std::string token_sha256)
    : dispatch_(dispatch), calls_(dispatch->calls), token_sha256_(std::move(token_sha256)) {}

absl::Status WorkerService::CheckToken(grpc::CallbackServerContext* ctx) const {
  return token_sha256_.empty() ? absl::OkStatus() : CheckBearerToken(AuthorizationOf(*ctx), token_sha256_);
}

template <typename Work>
grpc::ServerUnaryReactor* WorkerService::Defer(grpc::CallbackServerContext* ctx, const std::string* run_id, Work work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::Status s = CheckToken(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  auto task = [reactor, work = std::move(work)]() mutable {
    AfterAnswerScope after_answer;  // the step's figures and the call's log line once Finish has sent the answer
    reactor->Finish(ToGrpcStatus(work()));
  };
  if (run_id != nullptr) {
    dispatch_->device_calls.Submit(*run_id, std::move(task));
  } else {
    dispatch_->files.Submit(std::move(task));
  }
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Info(grpc::CallbackServerContext* ctx, const v1::WorkerInfoRequest*,
                                              v1::WorkerInfo* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status s = CheckToken(ctx);
  if (s.ok()) calls_.Info(resp);  // no device work: answered on the gRPC thread
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

// Every other call runs on its run's queue of the device-call executor: one run's calls in
// arrival order; different runs' calls reach WorkerCore side by side, where the device lock
// orders them (and co-scheduling may join their TrainSteps).
#define LORASTEP_WORKER_CALL(Method, Request, Response)                                              \
  grpc::ServerUnaryReactor* WorkerService::Method(grpc::CallbackServerContext* ctx, const Request* req, \
                                                  Response* resp) {                                  \
    return Defer(ctx, &req->run_id(), [this, req, resp] { return calls_.Method(*req, resp); });                      \
  }
#define LORASTEP_WORKER_CALL_NO_RESPONSE(Method, Request, Response)                                  \
  grpc::ServerUnaryReactor* WorkerService::Method(grpc::CallbackServerContext* ctx, const Request* req, \
                                                  Response*) {                                       \
    return Defer(ctx, &req->run_id(), [this, req] { return calls_.Method(*req); });                                 \
  }
// Waits for a background write off the device's queue: never behind (or in front of) a step.
grpc::ServerUnaryReactor* WorkerService::AwaitSaved(grpc::CallbackServerContext* ctx, const v1::WorkerPathRequest* req,
                                                    v1::WorkerPathResponse*) {
  return Defer(ctx, nullptr, [this, req] { return calls_.AwaitSaved(*req); });
}

LORASTEP_WORKER_CALL(CreateRun, v1::WorkerCreateRunRequest, v1::WorkerCreateRunResponse)
LORASTEP_WORKER_CALL_NO_RESPONSE(DeleteRun, v1::WorkerDeleteRunRequest, v1::WorkerDeleteRunResponse)
// Batch calls stop at their next micro-batch once the coordinator's call is cancelled (the
// client's deadline passed or it went away): nobody waits for the rest.
#define LORASTEP_WORKER_BATCH_CALL(Method, Request, Response)                                         \
  grpc::ServerUnaryReactor* WorkerService::Method(grpc::CallbackServerContext* ctx, const Request* req, \
                                                  Response* resp) {                                  \
    return Defer(ctx, &req->run_id(), [this, ctx, req, resp] {                                            \
      return calls_.Method(*req, resp, nullptr, [ctx] { return ctx->IsCancelled(); });              \
    });                                                                                              \
  }
LORASTEP_WORKER_BATCH_CALL(ForwardBackward, v1::WorkerForwardBackwardRequest, v1::WorkerForwardBackwardResponse)
LORASTEP_WORKER_BATCH_CALL(Forward, v1::WorkerForwardRequest, v1::WorkerForwardBackwardResponse)
LORASTEP_WORKER_CALL(OptimStep, v1::WorkerOptimStepRequest, v1::WorkerStepResponse)
// Ordered with the run's calls; stops between sampler steps once the caller's call is cancelled.
grpc::ServerUnaryReactor* WorkerService::Sample(grpc::CallbackServerContext* ctx, const v1::WorkerSampleRequest* req,
                                                v1::SampleResponse* resp) {
  return Defer(ctx, &req->run_id(), [this, ctx, req, resp] {
    return calls_.Sample(*req, resp, [ctx] { return ctx->IsCancelled(); });
  });
}
LORASTEP_WORKER_BATCH_CALL(TrainStep, v1::WorkerTrainStepRequest, v1::WorkerStepResponse)
LORASTEP_WORKER_CALL(SaveState, v1::WorkerPathRequest, v1::WorkerPathResponse)
LORASTEP_WORKER_CALL(LoadState, v1::WorkerPathRequest, v1::WorkerPathResponse)
LORASTEP_WORKER_CALL(ExportAdapter, v1::WorkerPathRequest, v1::WorkerPathResponse)
LORASTEP_WORKER_CALL(StoreAdapter, v1::WorkerStoreAdapterRequest, v1::WorkerPathResponse)  // loads on the device
// Calls that touch only the state store's files run on the files executor: removing an
// autosave takes long enough that, on the device's queue, the next step would wait for it.
grpc::ServerUnaryReactor* WorkerService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                         const v1::ListCheckpointsRequest* req,
                                                         v1::ListCheckpointsResponse* resp) {
  return Defer(ctx, nullptr, [this, req, resp] { return calls_.ListCheckpoints(*req, resp); });
}
grpc::ServerUnaryReactor* WorkerService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                          const v1::DeleteCheckpointRequest* req,
                                                          v1::DeleteCheckpointResponse*) {
  return Defer(ctx, nullptr, [this, req] { return calls_.DeleteCheckpoint(*req); });
}
#undef LORASTEP_WORKER_CALL
#undef LORASTEP_WORKER_BATCH_CALL
#undef LORASTEP_WORKER_CALL_NO_RESPONSE

}  // namespace lorastep
