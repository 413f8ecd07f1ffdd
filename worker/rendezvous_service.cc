#include "worker/rendezvous_service.h"

#include <utility>

#include "rpc/grpc_status.h"

namespace lorastep {

grpc::ServerUnaryReactor* RendezvousStoreService::Apply(grpc::CallbackServerContext* ctx,
                                                        const v1::StoreOpRequest* req, v1::StoreOpResponse* resp) {
  StoreOp op;
  op.kind = static_cast<StoreOp::Kind>(req->kind());
  op.keys.assign(req->keys().begin(), req->keys().end());
  op.value = req->value();
  op.expected = req->expected();
  op.delta = req->delta();
  absl::StatusOr<StoreAnswer> answer = host_->Apply(op);
  if (answer.ok()) {
    resp->set_found(answer->found);
    resp->set_value(std::move(answer->value));
    resp->set_number(answer->number);
  }
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(answer.status()));
  return reactor;
}

StoreTransport GrpcStoreTransport(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                                  std::string authorization) {
  std::shared_ptr<v1::RendezvousStore::Stub> stub = v1::RendezvousStore::NewStub(grpc::CreateChannel(address, credentials));
  return [stub, authorization = std::move(authorization)](const StoreOp& op, std::chrono::milliseconds timeout)
             -> absl::StatusOr<StoreAnswer> {
    v1::StoreOpRequest req;
    req.set_kind(static_cast<v1::StoreOpRequest::Kind>(op.kind));
    for (const std::string& key : op.keys) req.add_keys(key);
    req.set_value(op.value);
    req.set_expected(op.expected);
    req.set_delta(op.delta);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    ctx.set_wait_for_ready(true);  // rank 0 may still be starting: wait for it within the deadline
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    v1::StoreOpResponse resp;
    if (grpc::Status s = stub->Apply(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
    StoreAnswer answer;
    answer.found = resp.found();
    answer.value = resp.value();
    answer.number = resp.number();
    return answer;
  };
}

}  // namespace lorastep
