#include "worker/worker_service.h"

#include "lib/adamw.h"
#include "lib/status_macros.h"
#include "server/grpc_status.h"
#include "server/proto_convert.h"

namespace lorastep {
namespace {

void FillForwardResponse(const ForwardBackwardResult& r, v1::ForwardBackwardResponse* resp) {
  for (const auto& lp : r.logprobs) resp->add_logprobs()->mutable_values()->Add(lp.begin(), lp.end());
  MetricsToProto(r.metrics, resp->mutable_metrics());
}

void FillStepResponse(const OptimStepResult& r, v1::StepResponse* resp) {
  resp->set_learner_version(r.learner_version);
  resp->set_adapter_sha256(r.adapter_sha256);
  MetricsToProto(r.metrics, resp->mutable_metrics());
}

}  // namespace

template <typename Work>
grpc::ServerUnaryReactor* WorkerService::Defer(grpc::CallbackServerContext* ctx, Work work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  executor_.Submit([reactor, work = std::move(work)]() mutable {
    reactor->Finish(ToGrpcStatus(work()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Info(grpc::CallbackServerContext* ctx,
                                              const v1::WorkerInfoRequest*, v1::WorkerInfo* resp) {
  resp->set_model_path(core_->options().model_path);
  resp->set_device(core_->base().device.str());
  resp->set_dtype(c10::toString(core_->base().dtype));
  resp->set_vocab_size(core_->base().config.vocab_size);
  resp->set_num_runs(static_cast<int64_t>(core_->num_runs()));
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::CreateRun(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerCreateRunRequest* req,
                                                   v1::WorkerCreateRunResponse*) {
  return Defer(ctx, [this, req] {
    return core_->CreateRun(req->run_id(), LoraConfigFromProto(req->lora()), req->seed());
  });
}

grpc::ServerUnaryReactor* WorkerService::ForwardBackward(grpc::CallbackServerContext* ctx,
                                                         const v1::WorkerForwardBackwardRequest* req,
                                                         v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req->loss()));
    BatchTotals totals{req->batch_loss_tokens(), req->batch_samples()};
    LORASTEP_ASSIGN_OR_RETURN(
        ForwardBackwardResult r,
        core_->ForwardBackward(req->run_id(), DatumsFromProto(req->datums()), loss, totals));
    FillForwardResponse(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Forward(grpc::CallbackServerContext* ctx,
                                                 const v1::WorkerForwardRequest* req,
                                                 v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult r,
                              core_->Forward(req->run_id(), DatumsFromProto(req->datums())));
    FillForwardResponse(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::OptimStep(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerOptimStepRequest* req,
                                                   v1::StepResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req->adamw()));
    LORASTEP_ASSIGN_OR_RETURN(OptimStepResult r, core_->OptimStep(req->run_id(), adamw));
    FillStepResponse(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::TrainStep(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerTrainStepRequest* req,
                                                   v1::StepResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req->loss()));
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req->adamw()));
    BatchTotals totals{req->batch_loss_tokens(), req->batch_samples()};
    LORASTEP_ASSIGN_OR_RETURN(
        OptimStepResult r,
        core_->TrainStep(req->run_id(), DatumsFromProto(req->datums()), loss, adamw, totals,
                         req->max_tokens_per_microbatch()));
    FillStepResponse(r, resp);
    return absl::OkStatus();
  });
}

#define LORASTEP_WORKER_PATH_CALL(Method)                                                     \
  grpc::ServerUnaryReactor* WorkerService::Method(grpc::CallbackServerContext* ctx,          \
                                                  const v1::WorkerPathRequest* req,          \
                                                  v1::WorkerPathResponse* resp) {            \
    return Defer(ctx, [this, req, resp]() -> absl::Status {                                   \
      LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r, core_->Method(req->run_id(), req->path())); \
      resp->set_adapter_sha256(r.adapter_sha256);                                             \
      resp->set_learner_version(r.learner_version);                                           \
      return absl::OkStatus();                                                                \
    });                                                                                       \
  }
LORASTEP_WORKER_PATH_CALL(SaveState)
LORASTEP_WORKER_PATH_CALL(LoadState)
LORASTEP_WORKER_PATH_CALL(ExportAdapter)
#undef LORASTEP_WORKER_PATH_CALL

}  // namespace lorastep
