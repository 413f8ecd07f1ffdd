#include "server/coordinator_service.h"

#include <deque>
#include <functional>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "lib/io/state_store.h"
#include "rpc/grpc_status.h"

namespace lorastep {
namespace {

// Streams a run's step records: the kept backlog first, then each new record. Deletes
// itself in OnDone, after unregistering from the coordinator.
class MetricsWatchReactor final : public grpc::ServerWriteReactor<v1::StepRecord> {
 public:
  // `allowed`: the caller's authentication and access to the run; an error ends the stream.
  MetricsWatchReactor(Coordinator* core, const v1::WatchMetricsRequest& req, const absl::Status& allowed)
      : core_(core), run_id_(req.run_id()) {
    if (!allowed.ok()) {
      Finish(ToGrpcStatus(allowed));
      return;
    }
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

CoordinatorService::CoordinatorService(Coordinator* core, size_t executors, PrometheusRegistry* metrics,
                                       const ApiKeys* api_keys)
    : core_(core), api_keys_(api_keys), metrics_(metrics), executor_(executors) {
  if (metrics_ != nullptr) {
    metrics_->Declare("lorastep_queue_depth", PrometheusRegistry::Type::kGauge,
                      "Trainer calls accepted and not yet answered (queued behind their run, or running)");
    metrics_->Set("lorastep_queue_depth", {}, 0);
  }
}

absl::Status CoordinatorService::Admit(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(depth_mu_);
  int64_t& mine = in_flight_by_run_[run_id];
  if (in_flight_ >= max_total_ || mine >= max_per_run_) {
    const bool run_full = mine >= max_per_run_;
    if (mine == 0) in_flight_by_run_.erase(run_id);
    return absl::ResourceExhaustedError(
        run_full ? absl::StrCat("max_queued_per_run: run '", run_id, "' has ", max_per_run_,
                                " calls in flight; retry after some are answered (they run in order)")
                 : absl::StrCat("max_queued: ", max_total_, " calls in flight on this coordinator; retry with "
                                "backoff (from about ", std::max<int64_t>(100, in_flight_), " ms)"));
  }
  ++mine;
  ++in_flight_;
  PublishDepth();
  return absl::OkStatus();
}

void CoordinatorService::Done(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(depth_mu_);
  if (--in_flight_by_run_[run_id] <= 0) in_flight_by_run_.erase(run_id);
  --in_flight_;
  PublishDepth();
}

void CoordinatorService::PublishDepth() {
  if (metrics_ != nullptr) metrics_->Set("lorastep_queue_depth", {}, static_cast<double>(in_flight_));
}

absl::StatusOr<Caller> CoordinatorService::Authenticate(grpc::CallbackServerContext* ctx) const {
  if (api_keys_ == nullptr) return Caller{"", /*admin=*/true};  // no --api_keys_file
  return api_keys_->Authenticate(AuthorizationOf(*ctx));
}

absl::StatusOr<Caller> CoordinatorService::Authorize(grpc::CallbackServerContext* ctx, const std::string& run_id) {
  auto caller = Authenticate(ctx);
  if (!caller.ok()) return caller.status();
  if (absl::Status s = core_->CheckAccess(run_id, *caller); !s.ok()) return s;
  return caller;
}

absl::Status CoordinatorService::CheckPathAccess(const char* field, const std::string& path, const Caller& caller) {
  if (caller.admin || path.empty()) return absl::OkStatus();
  // With API keys, a caller names state only by reference, and only its own runs' state:
  // a raw path would reach any folder the workers can, another owner's checkpoints included.
  absl::string_view rest = path;
  if (!absl::ConsumePrefix(&rest, kStateRefScheme)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": with API keys only lorastep://<run>/<name> references are accepted (the server's --state_dir)"));
  }
  const std::string run(rest.substr(0, rest.find('/')));
  if (core_->CheckAccess(run, caller).ok()) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(field, ": no run '", run, "'"));
}

grpc::ServerUnaryReactor* CoordinatorService::Refuse(grpc::CallbackServerContext* ctx, const absl::Status& why) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(why));
  return reactor;
}

template <typename Resp, typename Call>
grpc::ServerUnaryReactor* CoordinatorService::Defer(grpc::CallbackServerContext* ctx,
                                                    const std::string& run_id, Resp* resp,
                                                    Call call, bool run_scoped) {
  // Authentication and ownership are checked before the call is queued.
  auto caller = run_scoped ? Authorize(ctx, run_id) : Authenticate(ctx);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  if (absl::Status admitted = Admit(run_id); !admitted.ok()) return Refuse(ctx, admitted);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  executor_.Submit(run_id, [this, reactor, resp, run_id, call = std::move(call), who = *caller]() mutable {
    auto result = call(who);
    if (result.ok()) *resp = std::move(result).value();
    Done(run_id);
    reactor->Finish(ToGrpcStatus(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::CreateRun(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateRunRequest* req,
                                                        v1::Run* resp) {
  return Defer(
      ctx, req->run_id(), resp, [this, req](const Caller& who) -> absl::StatusOr<v1::Run> {
        if (absl::Status s = CheckPathAccess("init_from", req->init_from(), who); !s.ok()) return s;
        return core_->CreateRun(*req, who.owner);
      },
      /*run_scoped=*/false);
}
grpc::ServerUnaryReactor* CoordinatorService::DeleteRun(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteRunRequest* req,
                                                        v1::DeleteRunResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) -> absl::StatusOr<v1::DeleteRunResponse> {
    absl::Status deleted = core_->DeleteRun(req->run_id());
    if (!deleted.ok()) return deleted;
    return v1::DeleteRunResponse();
  });
}
grpc::ServerUnaryReactor* CoordinatorService::GetRun(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRunRequest* req, v1::Run* resp) {
  if (auto caller = Authorize(ctx, req->run_id()); !caller.ok()) return Refuse(ctx, caller.status());
  auto* reactor = ctx->DefaultReactor();
  auto run = core_->GetRun(req->run_id());
  if (run.ok()) *resp = *run;
  reactor->Finish(ToGrpcStatus(run.status()));
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ListRuns(grpc::CallbackServerContext* ctx,
                                                       const v1::ListRunsRequest*,
                                                       v1::ListRunsResponse* resp) {
  auto caller = Authenticate(ctx);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  for (auto& r : core_->ListRuns()) {
    if (caller->admin || r.owner() == caller->owner) *resp->add_runs() = r;  // one's own runs
  }
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ForwardBackward(
    grpc::CallbackServerContext* ctx, const v1::ForwardBackwardRequest* req,
    v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) { return core_->ForwardBackward(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::Forward(grpc::CallbackServerContext* ctx,
                                                      const v1::ForwardRequest* req,
                                                      v1::ForwardBackwardResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) { return core_->Forward(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::OptimStep(grpc::CallbackServerContext* ctx,
                                                        const v1::OptimStepRequest* req,
                                                        v1::StepResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) { return core_->OptimStep(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::TrainStep(grpc::CallbackServerContext* ctx,
                                                        const v1::TrainStepRequest* req,
                                                        v1::StepResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) { return core_->TrainStep(*req); });
}
grpc::ServerUnaryReactor* CoordinatorService::SaveState(grpc::CallbackServerContext* ctx,
                                                        const v1::SaveStateRequest* req,
                                                        v1::SaveStateResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller& who) -> decltype(core_->SaveState(*req)) {
    if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
    return core_->SaveState(*req);
  });
}
grpc::ServerUnaryReactor* CoordinatorService::LoadState(grpc::CallbackServerContext* ctx,
                                                        const v1::LoadStateRequest* req,
                                                        v1::Run* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller& who) -> decltype(core_->LoadState(*req)) {
    if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
    return core_->LoadState(*req);
  });
}
grpc::ServerUnaryReactor* CoordinatorService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                              const v1::ListCheckpointsRequest* req,
                                                              v1::ListCheckpointsResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) { return core_->ListCheckpoints(*req); });
}

grpc::ServerUnaryReactor* CoordinatorService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::DeleteCheckpointRequest* req,
                                                               v1::DeleteCheckpointResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller&) -> absl::StatusOr<v1::DeleteCheckpointResponse> {
    absl::Status deleted = core_->DeleteCheckpoint(*req);
    if (!deleted.ok()) return deleted;
    return v1::DeleteCheckpointResponse();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::ExportAdapter(grpc::CallbackServerContext* ctx,
                                                            const v1::ExportAdapterRequest* req,
                                                            v1::ExportAdapterResponse* resp) {
  return Defer(ctx, req->run_id(), resp, [this, req](const Caller& who) -> decltype(core_->ExportAdapter(*req)) {
    if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
    return core_->ExportAdapter(*req);
  });
}
grpc::ServerUnaryReactor* CoordinatorService::GetStepMetrics(grpc::CallbackServerContext* ctx,
                                                             const v1::GetStepMetricsRequest* req,
                                                             v1::GetStepMetricsResponse* resp) {
  if (auto caller = Authorize(ctx, req->run_id()); !caller.ok()) return Refuse(ctx, caller.status());
  auto* reactor = ctx->DefaultReactor();
  auto r = core_->GetStepMetrics(*req);
  if (r.ok()) *resp = *r;
  reactor->Finish(ToGrpcStatus(r.status()));
  return reactor;
}
grpc::ServerWriteReactor<v1::StepRecord>* CoordinatorService::WatchMetrics(
    grpc::CallbackServerContext* ctx, const v1::WatchMetricsRequest* req) {
  return new MetricsWatchReactor(core_, *req, Authorize(ctx, req->run_id()).status());
}

}  // namespace lorastep
