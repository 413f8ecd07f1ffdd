#include "worker/worker_service.h"

#include <unistd.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lib/training/adamw.h"
#include "lib/status_macros.h"
#include "rpc/grpc_status.h"
#include "rpc/proto_convert.h"
#include "rpc/step_metrics.h"
#include "rpc/bearer_token.h"

namespace lorastep {
namespace {

void FillForwardResponse(const ForwardBackwardResult& r, v1::WorkerForwardBackwardResponse* resp) {
  for (const auto& lp : r.logprobs) {
    resp->mutable_result()->add_logprobs()->mutable_values()->Add(lp.begin(), lp.end());
  }
  MetricsToProto(r.metrics, resp->mutable_result()->mutable_metrics());
  MetricPartialsToProto(r.metrics, resp->mutable_partials());
}

void FillStepResponse(const OptimStepResult& r, v1::WorkerStepResponse* resp) {
  resp->mutable_result()->set_learner_version(r.learner_version);
  resp->mutable_result()->set_adapter_sha256(r.adapter_sha256);
  MetricsToProto(r.metrics, resp->mutable_result()->mutable_metrics());
  MetricPartialsToProto(r.metrics, resp->mutable_partials());
  for (const auto& [family, sha] : r.replica_digests) (*resp->mutable_replica_digests())[family] = sha;
}

MeshCallInfo MeshFromProto(const v1::MeshCall& mesh) {
  return MeshCallInfo{mesh.request_id().empty() ? -1 : mesh.expected_learner_version(),
                      mesh.mesh_generation()};
}

}  // namespace

absl::Status WorkerService::CheckToken(grpc::CallbackServerContext* ctx) const {
  return token_sha256_.empty() ? absl::OkStatus() : CheckBearerToken(AuthorizationOf(*ctx), token_sha256_);
}

namespace {
std::string RandomInstanceId() {
  std::random_device device;
  std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(getpid()));
  return absl::StrFormat("%016x%016x", rng(), rng());
}
}  // namespace

WorkerService::WorkerService(WorkerCore* core, PrometheusRegistry* metrics, std::string token_sha256)
    : core_(core), metrics_(metrics), instance_id_(RandomInstanceId()), token_sha256_(std::move(token_sha256)) {
  if (metrics_ != nullptr) DeclareStepMetrics(metrics_);
}

template <typename Work>
grpc::ServerUnaryReactor* WorkerService::Defer(grpc::CallbackServerContext* ctx, Work work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::Status s = CheckToken(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  executor_.Submit([reactor, work = std::move(work)]() mutable {
    reactor->Finish(ToGrpcStatus(work()));
  });
  return reactor;
}

template <typename Work>
grpc::ServerUnaryReactor* WorkerService::DeferOnce(grpc::CallbackServerContext* ctx,
                                                   const v1::MeshCall& mesh, const char* method,
                                                   google::protobuf::Message* resp, Work work) {
  return Defer(ctx, [this, &mesh, method, resp, work = std::move(work)]() mutable -> absl::Status {
    const std::string& id = mesh.request_id();
    if (!id.empty()) {
      auto it = recorded_.find(id);
      if (it != recorded_.end()) {
        if (it->second.first != method) {
          return absl::InvalidArgumentError(
              absl::StrCat("request_id: '", id, "' was used for ", it->second.first));
        }
        resp->ParseFromString(it->second.second);
        return absl::OkStatus();
      }
    }
    absl::Status s = work();
    if (s.ok() && !id.empty()) {
      recorded_[id] = {method, resp->SerializeAsString()};
      recorded_order_.push_back(id);
      while (recorded_order_.size() > kRecordedCalls) {
        recorded_.erase(recorded_order_.front());
        recorded_order_.pop_front();
      }
    }
    return s;
  });
}

grpc::ServerUnaryReactor* WorkerService::Info(grpc::CallbackServerContext* ctx,
                                              const v1::WorkerInfoRequest*, v1::WorkerInfo* resp) {
  if (absl::Status s = CheckToken(ctx); !s.ok()) {
    auto* refused = ctx->DefaultReactor();
    refused->Finish(ToGrpcStatus(s));
    return refused;
  }
  resp->set_model_path(core_->options().model_path);
  resp->set_device(core_->base().device.str());
  resp->set_dtype(c10::toString(core_->base().dtype));
  resp->set_vocab_size(core_->base().config.vocab_size);
  resp->set_num_runs(static_cast<int64_t>(core_->num_runs()));
  const WorkerOptions& o = core_->options();
  resp->set_rank(o.rank);
  resp->set_world_size(o.sizes.world());
  resp->set_tp(o.sizes.tp);
  resp->set_pp(o.sizes.pp);
  resp->set_dp(o.sizes.dp);
  resp->set_ep(o.sizes.ep);
  resp->set_instance_id(instance_id_);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::CreateRun(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerCreateRunRequest* req,
                                                   v1::WorkerCreateRunResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LoraConfig lora, LoraConfigFromProto(req->lora()));
    LORASTEP_ASSIGN_OR_RETURN(int64_t version,
                              core_->CreateRun(req->run_id(), lora, req->seed(),
                                               req->init_from(), req->init_with_optimizer()));
    resp->set_learner_version(version);
    return absl::OkStatus();
  });
}
grpc::ServerUnaryReactor* WorkerService::DeleteRun(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerDeleteRunRequest* req,
                                                   v1::WorkerDeleteRunResponse*) {
  return Defer(ctx, [this, req] {
    absl::Status deleted = core_->DeleteRun(req->run_id());
    if (deleted.ok() && metrics_ != nullptr) metrics_->RemoveSeries("run", req->run_id());
    return deleted;
  });
}

grpc::ServerUnaryReactor* WorkerService::ForwardBackward(grpc::CallbackServerContext* ctx,
                                                         const v1::WorkerForwardBackwardRequest* req,
                                                         v1::WorkerForwardBackwardResponse* resp) {
  return DeferOnce(ctx, req->mesh(), "ForwardBackward", resp, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req->loss()));
    BatchTotals totals{req->batch_loss_tokens(), req->batch_samples()};
    LORASTEP_ASSIGN_OR_RETURN(std::vector<Datum> datums, RequestDatums(req->datums(), req->packed_datums()));
    LORASTEP_ASSIGN_OR_RETURN(
        ForwardBackwardResult r,
        core_->ForwardBackward(req->run_id(), datums, loss, totals, MeshFromProto(req->mesh())));
    FillForwardResponse(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::Forward(grpc::CallbackServerContext* ctx,
                                                 const v1::WorkerForwardRequest* req,
                                                 v1::WorkerForwardBackwardResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(std::vector<Datum> datums, RequestDatums(req->datums(), req->packed_datums()));
    LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult r,
                              core_->Forward(req->run_id(), datums, MeshFromProto(req->mesh())));
    FillForwardResponse(r, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::OptimStep(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerOptimStepRequest* req,
                                                   v1::WorkerStepResponse* resp) {
  return DeferOnce(ctx, req->mesh(), "OptimStep", resp, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req->adamw()));
    LORASTEP_ASSIGN_OR_RETURN(OptimStepResult r,
                              core_->OptimStep(req->run_id(), adamw, MeshFromProto(req->mesh())));
    FillStepResponse(r, resp);
    RecordStepMetrics(metrics_, req->run_id(), "optim_step", resp->result().metrics(), r.learner_version);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::TrainStep(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerTrainStepRequest* req,
                                                   v1::WorkerStepResponse* resp) {
  return DeferOnce(ctx, req->mesh(), "TrainStep", resp, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req->loss()));
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req->adamw()));
    BatchTotals totals{req->batch_loss_tokens(), req->batch_samples()};
    LORASTEP_ASSIGN_OR_RETURN(std::vector<Datum> datums, RequestDatums(req->datums(), req->packed_datums()));
    LORASTEP_ASSIGN_OR_RETURN(
        OptimStepResult r,
        core_->TrainStep(req->run_id(), datums, loss, adamw, totals,
                         req->max_tokens_per_microbatch(), MeshFromProto(req->mesh())));
    FillStepResponse(r, resp);
    RecordStepMetrics(metrics_, req->run_id(), "train_step", resp->result().metrics(), r.learner_version);
    return absl::OkStatus();
  });
}

#define LORASTEP_WORKER_PATH_CALL(Method)                                                     \
  grpc::ServerUnaryReactor* WorkerService::Method(grpc::CallbackServerContext* ctx,          \
                                                  const v1::WorkerPathRequest* req,          \
                                                  v1::WorkerPathResponse* resp) {            \
    return Defer(ctx, [this, req, resp]() -> absl::Status {                                   \
      LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,                                    \
                                core_->Method(req->run_id(), req->path(), MeshFromProto(req->mesh()))); \
      resp->set_adapter_sha256(r.adapter_sha256);                                             \
      resp->set_learner_version(r.learner_version);                                           \
      return absl::OkStatus();                                                                \
    });                                                                                       \
  }
LORASTEP_WORKER_PATH_CALL(SaveState)
#undef LORASTEP_WORKER_PATH_CALL

grpc::ServerUnaryReactor* WorkerService::ExportAdapter(grpc::CallbackServerContext* ctx,
                                                       const v1::WorkerPathRequest* req,
                                                       v1::WorkerPathResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,
                              core_->ExportAdapter(req->run_id(), req->path(), MeshFromProto(req->mesh()),
                                                   req->expand_experts()));
    resp->set_adapter_sha256(r.adapter_sha256);
    resp->set_learner_version(r.learner_version);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                         const v1::ListCheckpointsRequest* req,
                                                         v1::ListCheckpointsResponse* resp) {
  return Defer(ctx, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(std::vector<StoredFolder> folders, core_->ListCheckpoints(req->run_id()));
    for (const StoredFolder& f : folders) {
      v1::Checkpoint* c = resp->add_checkpoints();
      c->set_name(f.name);
      c->set_ref(f.ref);
      c->set_bytes(f.bytes);
      c->set_modified_unix_s(f.modified_unix_s);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WorkerService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                          const v1::DeleteCheckpointRequest* req,
                                                          v1::DeleteCheckpointResponse*) {
  return Defer(ctx, [this, req] { return core_->DeleteCheckpoint(req->run_id(), req->name()); });
}

grpc::ServerUnaryReactor* WorkerService::LoadState(grpc::CallbackServerContext* ctx,
                                                   const v1::WorkerPathRequest* req,
                                                   v1::WorkerPathResponse* resp) {
  return DeferOnce(ctx, req->mesh(), "LoadState", resp, [this, req, resp]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,
                              core_->LoadState(req->run_id(), req->path(), MeshFromProto(req->mesh())));
    resp->set_adapter_sha256(r.adapter_sha256);
    resp->set_learner_version(r.learner_version);
    return absl::OkStatus();
  });
}

}  // namespace lorastep
