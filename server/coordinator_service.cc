#include "server/coordinator_service.h"

#include <deque>
#include <functional>
#include <mutex>

#include "rpc/grpc_status.h"

namespace lorastep {
namespace {

// Streams a run's step records: the kept backlog first, then each new record. Deletes
// itself in OnDone, after unregistering from the coordinator.
class MetricsWatchReactor final : public grpc::ServerWriteReactor<v1::StepRecord> {
 public:
  MetricsWatchReactor(Coordinator* core, const v1::WatchMetricsRequest& req)
      : core_(core), run_id_(req.run_id()) {
    std::vector<v1::StepRecord> backlog;
    auto id = core_->Watch(run_id_, req.since_step(),
                           [this](const v1::StepRecord& r) { Push(r); }, &backlog);
    if (!id.ok()) {
      Finish(ToGrpcStatus(id.status()));
      return;
    }
    watch_id_ = *id;
    for (const auto& r : backlog) Push(r);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.pop_front();
    if (!ok) {  // the client went away
      writing_ = false;
      return;
    }
    if (!queue_.empty()) {
      StartWrite(&queue_.front());
    } else {
      writing_ = false;
    }
  }

  void OnCancel() override {
    StopWatching();
    Finish(grpc::Status::OK);
  }

  void OnDone() override {
    StopWatching();
    delete this;
  }

 private:
  void Push(const v1::StepRecord& record) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(record);
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
  }

  void StopWatching() {
    if (watch_id_ > 0) core_->Unwatch(run_id_, watch_id_);
    watch_id_ = 0;
  }

  Coordinator* core_;
  std::string run_id_;
  int64_t watch_id_ = 0;
  std::mutex mu_;
  std::deque<v1::StepRecord> queue_;  // front is being written while writing_
  bool writing_ = false;
};

}  // namespace

CoordinatorService::CoordinatorService(Coordinator* core, size_t executors, PrometheusRegistry* metrics)
    : core_(core), metrics_(metrics), executor_(executors) {
  if (metrics_ != nullptr) {
    metrics_->Declare("lorastep_queue_depth", PrometheusRegistry::Type::kGauge,
                      "Trainer calls accepted and not yet answered (queued behind their run, or running)");
    metrics_->Set("lorastep_queue_depth", {}, 0);
  }
}

void CoordinatorService::QueueDepthChanged(int delta) {
  std::lock_guard<std::mutex> lock(depth_mu_);
  in_flight_ += delta;
  if (metrics_ != nullptr) metrics_->Set("lorastep_queue_depth", {}, static_cast<double>(in_flight_));
}

template <typename Resp, typename Call>
grpc::ServerUnaryReactor* CoordinatorService::Defer(grpc::CallbackServerContext* ctx,
                                                    const std::string& run_id, Resp* resp,
                                                    Call call) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  QueueDepthChanged(+1);
  executor_.Submit(run_id, [this, reactor, resp, call = std::move(call)]() mutable {
    auto result = call();
    if (result.ok()) *resp = std::move(result).value();
    QueueDepthChanged(-1);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::CreateRun(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateRunRequest* req,
                                                        v1::Run* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->CreateRun(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::DeleteRun(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteRunRequest* req,
                                                        v1::DeleteRunResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req]() -> absl::StatusOr<v1::DeleteRunResponse> {
    absl::Status deleted = core_->DeleteRun(req->run_id());
    if (!deleted.ok()) return deleted;
    return v1::DeleteRunResponse();
  });
}
grpc::ServerUnaryReactor* CoordinatorService::GetRun(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRunRequest* req, v1::Run* resp) {
  auto* reactor = ctx->DefaultReactor();
  auto run = core_->GetRun(req->run_id());
  if (run.ok()) *resp = *run;
  reactor->Finish(ToGrpcStatus(run.status()));
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ListRuns(grpc::CallbackServerContext* ctx,
                                                       const v1::ListRunsRequest*,
                                                       v1::ListRunsResponse* resp) {
  for (auto& r : core_->ListRuns()) *resp->add_runs() = r;
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ForwardBackward(
    grpc::CallbackServerContext* ctx, const v1::ForwardBackwardRequest* req,
    v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->ForwardBackward(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::Forward(grpc::CallbackServerContext* ctx,
                                                      const v1::ForwardRequest* req,
                                                      v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->Forward(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::OptimStep(grpc::CallbackServerContext* ctx,
                                                        const v1::OptimStepRequest* req,
                                                        v1::StepResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->OptimStep(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::TrainStep(grpc::CallbackServerContext* ctx,
                                                        const v1::TrainStepRequest* req,
                                                        v1::StepResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->TrainStep(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::SaveState(grpc::CallbackServerContext* ctx,
                                                        const v1::SaveStateRequest* req,
                                                        v1::SaveStateResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->SaveState(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::LoadState(grpc::CallbackServerContext* ctx,
                                                        const v1::LoadStateRequest* req,
                                                        v1::Run* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->LoadState(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                              const v1::ListCheckpointsRequest* req,
                                                              v1::ListCheckpointsResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->ListCheckpoints(*req); });
}

grpc::ServerUnaryReactor* CoordinatorService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::DeleteCheckpointRequest* req,
                                                               v1::DeleteCheckpointResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req]() -> absl::StatusOr<v1::DeleteCheckpointResponse> {
    absl::Status deleted = core_->DeleteCheckpoint(*req);
    if (!deleted.ok()) return deleted;
    return v1::DeleteCheckpointResponse();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::ExportAdapter(grpc::CallbackServerContext* ctx,
                                                            const v1::ExportAdapterRequest* req,
                                                            v1::ExportAdapterResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req] { return core_->ExportAdapter(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::GetStepMetrics(grpc::CallbackServerContext* ctx,
                                                             const v1::GetStepMetricsRequest* req,
                                                             v1::GetStepMetricsResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  auto r = core_->GetStepMetrics(*req);
  if (r.ok()) *resp = *r;
  reactor->Finish(ToGrpcStatus(r.status()));
  return reactor;
}
grpc::ServerWriteReactor<v1::StepRecord>* CoordinatorService::WatchMetrics(
    grpc::CallbackServerContext*, const v1::WatchMetricsRequest* req) {
  return new MetricsWatchReactor(core_, *req);
}

}  // namespace lorastep
