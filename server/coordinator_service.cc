#include "server/coordinator_service.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "lib/run_tenant.h"
#include "lib/io/state_store.h"
#include "lib/status_macros.h"
#include "server/run_names.h"
#include "lib/training/batch.h"
#include "rpc/grpc_status.h"
#include "rpc/serial_executor.h"
#include "rpc/wire_limits.h"

namespace lorastep {
namespace {

// A unary call whose cancellation (the client went away, its deadline passed, the server
// shuts down) cancels `token`: the work it queued stops, its worker calls are cancelled.
class CancellableReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit CancellableReactor(std::shared_ptr<CancelToken> token) : token_(std::move(token)) {}
  void OnCancel() override { token_->Cancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<CancelToken> token_;
};

// A response as `caller` may see it (HideOtherTenantsFigures); other responses as they are.
template <typename Resp>
void ForCaller(const Caller&, Resp*) {}
void ForCaller(const Caller& caller, v1::StepResponse* r) { HideOtherTenantsFigures(caller, r->mutable_metrics()); }
void ForCaller(const Caller& caller, v1::ForwardBackwardResponse* r) {
  HideOtherTenantsFigures(caller, r->mutable_metrics());
}
void ForCaller(const Caller& caller, v1::StepRecord* r) { HideOtherTenantsFigures(caller, r->mutable_metrics()); }
void ForCaller(const Caller& caller, v1::GetStepMetricsResponse* r) {
  for (v1::StepRecord& step : *r->mutable_steps()) ForCaller(caller, &step);
}

// Streams a run's step records: the kept backlog first, then each new record. Deletes
// itself in OnDone, after unregistering from the coordinator.
class MetricsWatchReactor final : public grpc::ServerWriteReactor<v1::StepRecord> {
 public:
  // `allowed`: the caller's authentication and access to the run; an error ends the stream.
  // `max_backlog`: records waiting for a slow client beyond which the stream ends
  // (RESOURCE_EXHAUSTED, naming the step to resume from) instead of growing without bound.
  // `caller`: whose stream it is (the records as that caller may see them, ForCaller).
  MetricsWatchReactor(Coordinator* core, const v1::WatchMetricsRequest& req, const absl::Status& allowed,
                      size_t max_backlog, Caller caller)
      : core_(core), run_id_(req.run_id()), max_backlog_(std::max<size_t>(max_backlog, 1)), caller_(std::move(caller)) {
    if (!allowed.ok()) {
      Finish(ToGrpcStatus(allowed));
      return;
    }
    auto id = core_->Watch(
        run_id_, req.since_step(), [this](const v1::StepRecord& r) { Push(r); },
        [this](std::vector<v1::StepRecord> backlog) {
          // Kept by the run anyway: not counted against max_backlog, only written first.
          std::lock_guard<std::mutex> lock(mu_);
          backlog_queued_ = backlog.size();
          for (auto& r : backlog) {
            ForCaller(caller_, &r);
            queue_.push_back(std::move(r));
          }
          StartNextWrite();
        });
    if (!id.ok()) {
      Finish(ToGrpcStatus(id.status()));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    watch_id_ = *id;
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.pop_front();
    if (backlog_queued_ > 0) --backlog_queued_;
    if (!ok) {  // the client went away
      writing_ = false;
      return;
    }
    if (overflowed_) {  // the records after the one just written were dropped
      writing_ = false;
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("max_watch_backlog: the client fell ", max_backlog_,
                                       " step records behind; none is lost from the run's history: watch again "
                                       "with since_step = ", resume_step_)));
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
    if (overflowed_) return;
    if (queue_.size() - backlog_queued_ >= max_backlog_) {  // the front is being written: the rest goes
      overflowed_ = true;
      resume_step_ = queue_.size() > 1 ? queue_[1].step() : record.step();
      queue_.resize(1);
      backlog_queued_ = std::min<size_t>(backlog_queued_, 1);
      return;  // the stream ends once the front is written; unregistered in OnDone
    }
    queue_.push_back(record);
    ForCaller(caller_, &queue_.back());
    StartNextWrite();
  }

  void StartNextWrite() {  // requires mu_
    if (writing_ || queue_.empty()) return;
    writing_ = true;
    StartWrite(&queue_.front());
  }

  void StopWatching() {
    int64_t id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = std::exchange(watch_id_, 0);
    }
    if (id > 0) core_->Unwatch(run_id_, id);  // not under mu_: the watcher takes it under the watch lock
  }

  Coordinator* core_;
  std::string run_id_;
  int64_t watch_id_ = 0;
  std::mutex mu_;
  const size_t max_backlog_;
  const Caller caller_;
  // Front is being written while writing_; then the backlog's records (backlog_queued_ of
  // them), then at most max_backlog_ new ones.
  std::deque<v1::StepRecord> queue_;
  size_t backlog_queued_ = 0;
  bool writing_ = false;
  bool overflowed_ = false;  // the client fell behind: the stream ends after the write in flight
  int64_t resume_step_ = 0;  // the first record dropped
};

}  // namespace

CoordinatorService::CoordinatorService(Coordinator* core, size_t executors, PrometheusRegistry* metrics,
                                       const ApiKeys* api_keys, std::chrono::microseconds executor_spin)
    : core_(core),
      api_keys_(api_keys),
      metrics_(metrics),
      admission_(std::make_unique<Admission>(AdmissionLimits(), metrics)),
      executor_(executors, executor_spin, TenantOfRun) {}

absl::StatusOr<Caller> CoordinatorService::Authenticate(grpc::CallbackServerContext* ctx) const {
  if (api_keys_ == nullptr) return Caller{"", /*admin=*/true};  // no --api_keys_file
  return api_keys_->Authenticate(AuthorizationOf(*ctx));
}

absl::Status CoordinatorService::CheckRunAccess(const std::string& client_id, const std::string& server_id,
                                                const Caller& caller) {
  if (absl::Status s = core_->CheckAccess(server_id, caller); !s.ok()) {
    // Named as the caller named it: the server's id is not the caller's business.
    return absl::IsNotFound(s) ? absl::NotFoundError(absl::StrCat("run_id: no run '", client_id, "'")) : s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Caller> CoordinatorService::Authorize(grpc::CallbackServerContext* ctx, const std::string& run_id,
                                                     std::string* server_id) {
  auto caller = Authenticate(ctx);
  if (!caller.ok()) return caller.status();
  *server_id = ServerRunId(*caller, run_id);
  if (absl::Status s = CheckRunAccess(run_id, *server_id, *caller); !s.ok()) return s;
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
  if (core_->CheckAccess(ServerRunId(caller, run), caller).ok()) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(field, ": no run '", run, "'"));
}

grpc::ServerUnaryReactor* CoordinatorService::Refuse(grpc::CallbackServerContext* ctx, const absl::Status& why) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(why));
  return reactor;
}

namespace {

// `req` as the server keeps it: its run id and path field (`path_field`, may be null) in
// the server's names (run_names.h). A copy only when they differ, i.e. with API keys.
template <typename Req>
const Req& ServerRequest(const Req& req, const Caller& caller, const std::string& server_id,
                         std::string* (Req::*path_field)(), const std::string& path, std::optional<Req>* copy) {
  const std::string server_path = path_field != nullptr ? ServerRef(caller, path) : path;
  if (req.run_id() == server_id && server_path == path) return req;
  copy->emplace(req);
  (*copy)->set_run_id(server_id);
  if (path_field != nullptr) *((**copy).*path_field)() = server_path;
  return **copy;
}

template <typename Req>
const Req& ServerRequest(const Req& req, const Caller& caller, const std::string& server_id, std::optional<Req>* copy) {
  return ServerRequest<Req>(req, caller, server_id, nullptr, "", copy);
}

// A Run as `caller` knows it.
v1::Run ClientRun(v1::Run run, const Caller& caller) {
  run.set_run_id(ClientRunId(caller, run.run_id()));
  return run;
}

}  // namespace

template <typename Resp, typename Call>
grpc::ServerUnaryReactor* CoordinatorService::Defer(grpc::CallbackServerContext* ctx,
                                                    const std::string& run_id, Resp* resp,
                                                    Call call, bool run_scoped,
                                                    std::function<void()> before_finish,
                                                    std::function<absl::Status(const std::string&)> before_queue,
                                                    AdmissionTicket ticket, std::shared_ptr<CancelToken> cancel) {
  // Authentication and ownership are checked before the call is queued, on the server's
  // id of the run (per owner with API keys).
  std::string server_id;
  auto caller = run_scoped ? Authorize(ctx, run_id, &server_id) : Authenticate(ctx);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  if (!run_scoped) server_id = ServerRunId(*caller, run_id);
  if (!ticket.held()) {
    auto admitted = admission_->Admit(caller->owner, /*bytes=*/0);  // parsed by gRPC already: small
    if (!admitted.ok()) return Refuse(ctx, admitted.status());
    ticket = *std::move(admitted);
  }
  if (absl::Status joined = ticket.JoinRun(server_id); !joined.ok()) return Refuse(ctx, joined);
  if (before_queue) {
    if (absl::Status s = before_queue(server_id); !s.ok()) return Refuse(ctx, ClientStatus(*caller, s));
  }
  if (cancel == nullptr) cancel = std::make_shared<CancelToken>();
  grpc::ServerUnaryReactor* reactor = new CancellableReactor(cancel);
  auto held = std::make_shared<AdmissionTicket>(std::move(ticket));  // released once answered
  executor_.Submit(server_id, [this, reactor, resp, server_id, call = std::move(call), who = *caller,
                               before_finish = std::move(before_finish), held, cancel]() mutable {
    AfterAnswerScope after_answer;  // metrics and the call's log line once Finish has sent the answer
    // A call whose client went away while it waited for its turn is not started.
    auto result = cancel->cancelled()
                      ? decltype(call(who, server_id))(absl::CancelledError("the caller went away before the call ran"))
                      : call(who, server_id);
    if (result.ok()) {
      *resp = std::move(result).value();
      ForCaller(who, resp);
      if (before_finish) before_finish();
    }
    held->Release();
    reactor->Finish(ToGrpcStatus(ClientStatus(who, result.status())));
    if (warmth_ != nullptr) warmth_->Answered();
  });
  return reactor;
}

std::function<absl::Status(const std::string&)> CoordinatorService::ClaimBeforeQueue(
    int64_t sequence_id, const std::string& request_id, std::shared_ptr<Coordinator::SequenceClaim> claim) {
  return [this, sequence_id, request_id, claim](const std::string& server_id) -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(*claim, core_->ClaimSequence(server_id, sequence_id, request_id));
    return absl::OkStatus();
  };
}

std::set<std::string> CoordinatorService::RawMethods() {
  return {"/lorastep.v1.Trainer/TrainStep", "/lorastep.v1.Trainer/ForwardBackward", "/lorastep.v1.Trainer/Forward"};
}

template <typename Req, typename Resp, typename Call>
grpc::ServerUnaryReactor* CoordinatorService::DeferRaw(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer& raw_req, grpc::ByteBuffer* raw_resp,
                                                       Call call) {
  // The key first (also checked on the headers where the credentials carry the check), then
  // its share of the queue and of the bytes held (the body is in memory already: it counts
  // from here), then the datums counted on the wire, then the parse.
  auto caller = Authenticate(ctx);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  auto ticket = admission_->Admit(caller->owner, static_cast<int64_t>(raw_req.Length()));
  if (!ticket.ok()) return Refuse(ctx, ticket.status());
  struct Owned {
    Req req;
    std::optional<PackedDatumsWire> packed;  // left where gRPC holds them
    Resp resp;
    std::shared_ptr<CancelToken> cancel = std::make_shared<CancelToken>();  // the client's call
    Coordinator::SequenceClaim claim;  // held until the call is answered
  };
  auto owned = std::make_shared<Owned>();
  // What parsing may take is charged before the parse (a batch of one-byte tokens in `datums`
  // parses to 8 bytes a token).
  AdmissionTicket* held = &*ticket;
  if (absl::Status s = ParseBoundedRequest(raw_req, BatchLimits().max_datums, &owned->req, &owned->packed,
                                           [held](int64_t parse_bytes) { return held->AddBytes(parse_bytes); });
      !s.ok()) {
    return Refuse(ctx, s);
  }
  return Defer(
      ctx, owned->req.run_id(), &owned->resp,
      [owned, call = std::move(call)](const Caller& who, const std::string& id) {
        auto result = call(who, id, owned->req, owned->packed ? &*owned->packed : nullptr, owned->cancel.get());
        owned->claim = {};  // before the answer leaves: the client's next call may take the id
        return result;
      },
      /*run_scoped=*/true,
      [owned, raw_resp] {
        bool own_buffer = false;
        (void)grpc::SerializationTraits<Resp>::Serialize(owned->resp, raw_resp, &own_buffer);
      },
      [this, owned](const std::string& server_id) -> absl::Status {
        if constexpr (!std::is_same_v<Req, v1::ForwardRequest>) {  // a mutating call: its sequence id
          LORASTEP_ASSIGN_OR_RETURN(owned->claim,
                                    core_->ClaimSequence(server_id, owned->req.sequence_id(), owned->req.request_id()));
        }
        if (!owned->packed) return absl::OkStatus();
        bool values_needed = false;  // ForwardBackward reads a batch that carries whole-batch totals
        if constexpr (std::is_same_v<Req, v1::ForwardBackwardRequest>) values_needed = owned->req.has_batch_totals();
        core_->StageBatch(server_id, &*owned->packed, values_needed);
        return absl::OkStatus();
      },
      *std::move(ticket), owned->cancel);
}

grpc::ServerUnaryReactor* CoordinatorService::CreateRun(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateRunRequest* req,
                                                        v1::Run* resp) {
  return Defer(
      ctx, req->run_id(), resp,
      [this, req](const Caller& who, const std::string&) -> absl::StatusOr<v1::Run> {
        if (absl::Status s = CheckPathAccess("init_from", req->init_from(), who); !s.ok()) return s;
        // The run id stays the client's here (fingerprints, validation); the core puts the
        // owner's prefix before it.
        std::optional<v1::CreateRunRequest> copy;
        const v1::CreateRunRequest& r =
            ServerRequest(*req, who, req->run_id(), &v1::CreateRunRequest::mutable_init_from, req->init_from(), &copy);
        LORASTEP_ASSIGN_OR_RETURN(v1::Run run, core_->CreateRun(r, who.owner, OwnerRunPrefix(who.owner)));
        return ClientRun(std::move(run), who);
      },
      /*run_scoped=*/false);
}
grpc::ServerUnaryReactor* CoordinatorService::DeleteRun(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteRunRequest* req,
                                                        v1::DeleteRunResponse* resp) {
  return Defer(ctx, req->run_id(), resp,
               [this](const Caller&, const std::string& id) -> absl::StatusOr<v1::DeleteRunResponse> {
                 absl::Status deleted = core_->DeleteRun(id);
                 if (!deleted.ok()) return deleted;
                 return v1::DeleteRunResponse();
               });
}
grpc::ServerUnaryReactor* CoordinatorService::GetRun(grpc::CallbackServerContext* ctx,
                                                     const v1::GetRunRequest* req, v1::Run* resp) {
  std::string id;
  auto caller = Authorize(ctx, req->run_id(), &id);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  auto* reactor = ctx->DefaultReactor();
  auto run = core_->GetRun(id);
  if (run.ok()) *resp = ClientRun(*std::move(run), *caller);
  reactor->Finish(ToGrpcStatus(ClientStatus(*caller, run.status())));
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ListRuns(grpc::CallbackServerContext* ctx,
                                                       const v1::ListRunsRequest*,
                                                       v1::ListRunsResponse* resp) {
  auto caller = Authenticate(ctx);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  for (auto& r : core_->ListRuns()) {
    // One's own runs by one's own ids; an admin sees the others' by the server's ids.
    if (caller->admin || r.owner() == caller->owner) *resp->add_runs() = ClientRun(std::move(r), *caller);
  }
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}
grpc::ServerUnaryReactor* CoordinatorService::ForwardBackward(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) {
  return DeferRaw<v1::ForwardBackwardRequest, v1::ForwardBackwardResponse>(
      ctx, *req, resp,
      [this, ctx](const Caller& who, const std::string& id, const v1::ForwardBackwardRequest& r,
                  const PackedDatumsWire* packed, CancelToken* cancel) {
        std::optional<v1::ForwardBackwardRequest> copy;
        return core_->ForwardBackward(ServerRequest(r, who, id, &copy), ctx->deadline(), packed, cancel);
      });
}
grpc::ServerUnaryReactor* CoordinatorService::Forward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                                      grpc::ByteBuffer* resp) {
  return DeferRaw<v1::ForwardRequest, v1::ForwardBackwardResponse>(
      ctx, *req, resp,
      [this, ctx](const Caller& who, const std::string& id, const v1::ForwardRequest& r, const PackedDatumsWire* packed,
                  CancelToken* cancel) {
        std::optional<v1::ForwardRequest> copy;
        return core_->Forward(ServerRequest(r, who, id, &copy), ctx->deadline(), packed, cancel);
      });
}
grpc::ServerUnaryReactor* CoordinatorService::OptimStep(grpc::CallbackServerContext* ctx,
                                                        const v1::OptimStepRequest* req,
                                                        v1::StepResponse* resp) {
  auto claim = std::make_shared<Coordinator::SequenceClaim>();  // held until the call is answered
  return Defer(
      ctx, req->run_id(), resp,
      [this, req, claim](const Caller& who, const std::string& id) {
        std::optional<v1::OptimStepRequest> copy;
        auto result = core_->OptimStep(ServerRequest(*req, who, id, &copy));
        *claim = {};  // before the answer leaves: the client's next call may take the id
        return result;
      },
      /*run_scoped=*/true, nullptr, ClaimBeforeQueue(req->sequence_id(), req->request_id(), claim));
}
grpc::ServerUnaryReactor* CoordinatorService::TrainStep(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  return DeferRaw<v1::TrainStepRequest, v1::StepResponse>(
      ctx, *req, resp,
      [this, ctx](const Caller& who, const std::string& id, const v1::TrainStepRequest& r,
                  const PackedDatumsWire* packed, CancelToken* cancel) {
        std::optional<v1::TrainStepRequest> copy;  // with API keys, of the request without its packed datums
        return core_->TrainStep(ServerRequest(r, who, id, &copy), ctx->deadline(), packed, cancel);
      });
}
grpc::ServerUnaryReactor* CoordinatorService::SaveState(grpc::CallbackServerContext* ctx,
                                                        const v1::SaveStateRequest* req,
                                                        v1::SaveStateResponse* resp) {
  return Defer(ctx, req->run_id(), resp,
               [this, req](const Caller& who, const std::string& id) -> absl::StatusOr<v1::SaveStateResponse> {
                 if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
                 std::optional<v1::SaveStateRequest> copy;
                 LORASTEP_ASSIGN_OR_RETURN(
                     v1::SaveStateResponse saved,
                     core_->SaveState(ServerRequest(*req, who, id, &v1::SaveStateRequest::mutable_path, req->path(), &copy)));
                 saved.set_path(ClientRef(who, saved.path()));
                 return saved;
               });
}
grpc::ServerUnaryReactor* CoordinatorService::LoadState(grpc::CallbackServerContext* ctx,
                                                        const v1::LoadStateRequest* req,
                                                        v1::Run* resp) {
  auto claim = std::make_shared<Coordinator::SequenceClaim>();  // held until the call is answered
  return Defer(
      ctx, req->run_id(), resp,
      [this, req, claim](const Caller& who, const std::string& id) -> absl::StatusOr<v1::Run> {
        absl::Cleanup release = [&] { *claim = {}; };  // before the answer leaves: the next call may take the id
        if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
        std::optional<v1::LoadStateRequest> copy;
        LORASTEP_ASSIGN_OR_RETURN(v1::Run run, core_->LoadState(ServerRequest(
                                                   *req, who, id, &v1::LoadStateRequest::mutable_path, req->path(), &copy)));
        return ClientRun(std::move(run), who);
      },
      /*run_scoped=*/true, nullptr, ClaimBeforeQueue(req->sequence_id(), req->request_id(), claim));
}
grpc::ServerUnaryReactor* CoordinatorService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                              const v1::ListCheckpointsRequest* req,
                                                              v1::ListCheckpointsResponse* resp) {
  return Defer(ctx, req->run_id(), resp,
               [this, req](const Caller& who, const std::string& id) -> absl::StatusOr<v1::ListCheckpointsResponse> {
                 std::optional<v1::ListCheckpointsRequest> copy;
                 LORASTEP_ASSIGN_OR_RETURN(v1::ListCheckpointsResponse listed,
                                           core_->ListCheckpoints(ServerRequest(*req, who, id, &copy)));
                 for (v1::Checkpoint& c : *listed.mutable_checkpoints()) c.set_ref(ClientRef(who, c.ref()));
                 return listed;
               });
}

grpc::ServerUnaryReactor* CoordinatorService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::DeleteCheckpointRequest* req,
                                                               v1::DeleteCheckpointResponse* resp) {
  return Defer(ctx, req->run_id(), resp,
               [this, req](const Caller& who, const std::string& id) -> absl::StatusOr<v1::DeleteCheckpointResponse> {
                 std::optional<v1::DeleteCheckpointRequest> copy;
                 absl::Status deleted = core_->DeleteCheckpoint(ServerRequest(*req, who, id, &copy));
                 if (!deleted.ok()) return deleted;
                 return v1::DeleteCheckpointResponse();
               });
}

grpc::ServerUnaryReactor* CoordinatorService::ExportAdapter(grpc::CallbackServerContext* ctx,
                                                            const v1::ExportAdapterRequest* req,
                                                            v1::ExportAdapterResponse* resp) {
  return Defer(ctx, req->run_id(), resp,
               [this, req](const Caller& who, const std::string& id) -> absl::StatusOr<v1::ExportAdapterResponse> {
                 if (absl::Status s = CheckPathAccess("path", req->path(), who); !s.ok()) return s;
                 std::optional<v1::ExportAdapterRequest> copy;
                 LORASTEP_ASSIGN_OR_RETURN(
                     v1::ExportAdapterResponse exported,
                     core_->ExportAdapter(
                         ServerRequest(*req, who, id, &v1::ExportAdapterRequest::mutable_path, req->path(), &copy)));
                 exported.set_path(ClientRef(who, exported.path()));
                 return exported;
               });
}
grpc::ServerUnaryReactor* CoordinatorService::Sample(grpc::CallbackServerContext* ctx, const v1::SampleRequest* req,
                                                     v1::SampleResponse* resp) {
  auto cancel = std::make_shared<CancelToken>();
  return Defer(
      ctx, req->run_id(), resp,
      [this, req, cancel](const Caller& who, const std::string& id) -> absl::StatusOr<v1::SampleResponse> {
        std::optional<v1::SampleRequest> copy;
        if (req->checkpoint().empty()) return core_->Sample(ServerRequest(*req, who, id, &copy), cancel.get());
        if (absl::Status s = CheckPathAccess("checkpoint", req->checkpoint(), who); !s.ok()) return s;
        return core_->Sample(
            ServerRequest(*req, who, id, &v1::SampleRequest::mutable_checkpoint, req->checkpoint(), &copy),
            cancel.get());
      },
      /*run_scoped=*/true, nullptr, nullptr, AdmissionTicket(), cancel);
}

grpc::ServerUnaryReactor* CoordinatorService::GetStepMetrics(grpc::CallbackServerContext* ctx,
                                                             const v1::GetStepMetricsRequest* req,
                                                             v1::GetStepMetricsResponse* resp) {
  std::string id;
  auto caller = Authorize(ctx, req->run_id(), &id);
  if (!caller.ok()) return Refuse(ctx, caller.status());
  auto* reactor = ctx->DefaultReactor();
  std::optional<v1::GetStepMetricsRequest> copy;
  auto r = core_->GetStepMetrics(ServerRequest(*req, *caller, id, &copy));
  if (r.ok()) {
    *resp = *r;
    ForCaller(*caller, resp);
  }
  reactor->Finish(ToGrpcStatus(ClientStatus(*caller, r.status())));
  return reactor;
}
grpc::ServerWriteReactor<v1::StepRecord>* CoordinatorService::WatchMetrics(
    grpc::CallbackServerContext* ctx, const v1::WatchMetricsRequest* req) {
  std::string id;
  auto caller = Authorize(ctx, req->run_id(), &id);
  v1::WatchMetricsRequest server_req = *req;
  server_req.set_run_id(id);
  return new MetricsWatchReactor(core_, server_req, caller.status(), max_watch_backlog_,
                                 caller.ok() ? *caller : Caller{});
}

// UploadAdapter: authenticates, reads the chunks (the two files, at most the upload limit),
// then stores the adapter on the run's executor like any call of the run. Deletes itself in
// OnDone.
class UploadAdapterReactor final : public grpc::ServerReadReactor<v1::UploadAdapterChunk> {
 public:
  UploadAdapterReactor(CoordinatorService* service, grpc::CallbackServerContext* ctx, v1::UploadAdapterResponse* resp)
      : service_(service), ctx_(ctx), resp_(resp) {
    auto caller = service_->Authenticate(ctx_);
    if (!caller.ok()) {
      Finish(ToGrpcStatus(caller.status()));
      return;
    }
    // Counted as a call of its key from the first chunk on; each chunk's bytes are charged
    // to the key's share as they arrive.
    auto admitted = service_->admission_->Admit(caller->owner, 0);
    if (!admitted.ok()) {
      Finish(ToGrpcStatus(admitted.status()));
      return;
    }
    ticket_ = *std::move(admitted);
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending
      Complete();
      return;
    }
    if (absl::Status s = Take(); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    if (first_) {
      first_ = false;
      run_id_ = chunk_.run_id();
      path_ = chunk_.path();
      replace_ = chunk_.replace();
      if (run_id_.empty()) return absl::InvalidArgumentError("run_id: required in the first message");
      if (path_.empty()) return absl::InvalidArgumentError("path: required in the first message");
    } else if (!chunk_.run_id().empty() || !chunk_.path().empty() || chunk_.replace()) {
      return absl::InvalidArgumentError("run_id, path, replace: only in the first message");
    }
    std::string* file = chunk_.file() == "adapter_config.json"         ? &config_
                        : chunk_.file() == "adapter_model.safetensors" ? &model_
                                                                        : nullptr;
    if (file == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file: '", chunk_.file().substr(0, 64), "' is not adapter_config.json or adapter_model.safetensors"));
    }
    if (static_cast<int64_t>(config_.size() + model_.size() + chunk_.data().size()) > service_->max_upload_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat("max_upload_mb: the adapter is larger than ",
                                                       service_->max_upload_bytes_ >> 20, " MiB"));
    }
    LORASTEP_RETURN_IF_ERROR(ticket_.AddBytes(static_cast<int64_t>(chunk_.data().size())));
    file->append(chunk_.data());
    chunk_.Clear();
    return absl::OkStatus();
  }

  void Complete() {
    std::string server_id;
    auto caller = service_->Authorize(ctx_, run_id_, &server_id);
    if (!caller.ok()) return Finish(ToGrpcStatus(caller.status()));
    if (absl::Status s = service_->CheckPathAccess("path", path_, *caller); !s.ok()) return Finish(ToGrpcStatus(s));
    if (config_.empty() || model_.empty()) {
      return Finish(ToGrpcStatus(absl::InvalidArgumentError(
          "file: both adapter_config.json and adapter_model.safetensors are required")));
    }
    if (absl::Status joined = ticket_.JoinRun(server_id); !joined.ok()) return Finish(ToGrpcStatus(joined));
    service_->executor_.Submit(server_id, [this, server_id, who = *caller] {
      auto stored = service_->core_->UploadAdapter(server_id, ServerRef(who, path_), config_, model_, replace_);
      if (stored.ok()) {
        *resp_ = *std::move(stored);
        resp_->set_path(ClientRef(who, resp_->path()));
      }
      config_.clear();
      model_.clear();
      ticket_.Release();
      Finish(ToGrpcStatus(ClientStatus(who, stored.status())));
    });
  }

  CoordinatorService* service_;
  grpc::CallbackServerContext* ctx_;
  v1::UploadAdapterResponse* resp_;
  v1::UploadAdapterChunk chunk_;
  bool first_ = true;
  bool replace_ = false;
  std::string run_id_, path_, config_, model_;
  AdmissionTicket ticket_;  // released once answered (or with the reactor)
};

grpc::ServerReadReactor<v1::UploadAdapterChunk>* CoordinatorService::UploadAdapter(grpc::CallbackServerContext* ctx,
                                                                                   v1::UploadAdapterResponse* resp) {
  return new UploadAdapterReactor(this, ctx, resp);
}

}  // namespace lorastep
