// The one place where absl::Status and grpc::Status are converted (both directions).
#ifndef LORASTEP_RPC_GRPC_STATUS_H_
#define LORASTEP_RPC_GRPC_STATUS_H_

#include <chrono>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lorastep {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// The call's "authorization" metadata value ("" when absent).
inline std::string AuthorizationOf(const grpc::ServerContextBase& ctx) {
  auto it = ctx.client_metadata().find("authorization");
  return it == ctx.client_metadata().end() ? std::string() : std::string(it->second.data(), it->second.size());
}

// One blocking unary call on a generated stub, as absl::StatusOr. `timeout` > 0 sets the
// call's deadline (DEADLINE_EXCEEDED when it passes).
template <typename Resp, typename Stub, typename Req, typename Method>
absl::StatusOr<Resp> CallUnary(Stub* stub, Method method, const Req& req,
                               std::chrono::seconds timeout = std::chrono::seconds(0),
                               const std::string& authorization = "") {
  grpc::ClientContext ctx;
  if (timeout.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  Resp resp;
  grpc::Status s = (stub->*method)(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

}  // namespace lorastep

#endif  // LORASTEP_RPC_GRPC_STATUS_H_
