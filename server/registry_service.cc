#include "server/registry_service.h"

#include "lib/log.h"
#include "lib/status_macros.h"
#include "rpc/grpc_status.h"
#include "server/grpc_worker_client.h"

namespace lorastep {

absl::Status RegistryService::CheckToken(grpc::CallbackServerContext* ctx) const {
  // Without a secret the Registry admits no one (rpc/security_policy.h).
  if (token_sha256_.empty()) {
    return absl::UnauthenticatedError("this coordinator holds no cluster secret: its Registry admits no worker");
  }
  return CheckBearerToken(AuthorizationOf(*ctx), token_sha256_);
}

grpc::ServerUnaryReactor* RegistryService::RegisterWorker(grpc::CallbackServerContext* ctx,
                                                          const v1::RegisterWorkerRequest* req,
                                                          v1::RegisterWorkerResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::Status s = CheckToken(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  executor_.Submit([this, reactor, req, resp] {
    absl::Status status = [&]() -> absl::Status {
      if (req->address().empty()) return absl::InvalidArgumentError("address: required");
      auto worker = std::make_unique<GrpcWorkerClient>(req->address(), std::chrono::seconds(3600), worker_token_,
                                                       worker_tls_);
      LORASTEP_RETURN_IF_ERROR(worker->WaitReady(30));
      LORASTEP_RETURN_IF_ERROR(core_->AddWorker(std::move(worker)));
      resp->set_num_workers(static_cast<int64_t>(core_->num_workers()));
      LORASTEP_LOG(Info) << "lorastep_coordinator: worker " << req->address() << " registered ("
                         << resp->num_workers() << " in all)";
      return absl::OkStatus();
    }();
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::JoinMesh(grpc::CallbackServerContext* ctx,
                                                    const v1::JoinMeshRequest* req,
                                                    v1::JoinMeshResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status status = [&]() -> absl::Status {
    LORASTEP_RETURN_IF_ERROR(CheckToken(ctx));
    LORASTEP_ASSIGN_OR_RETURN(MeshAssignment a, core_->AssignRank(req->host()));
    resp->set_rank(a.rank);
    resp->set_tp(a.sizes.tp);
    resp->set_pp(a.sizes.pp);
    resp->set_dp(a.sizes.dp);
    resp->set_ep(a.sizes.ep);
    resp->set_cp(a.sizes.cp);
    resp->set_rendezvous(a.rendezvous);
    LORASTEP_LOG(Info) << "lorastep_coordinator: rank " << a.rank << " given to " << req->host();
    return absl::OkStatus();
  }();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace lorastep
