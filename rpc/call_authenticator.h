// Who may call which methods, checked on a call's initial metadata before gRPC reads its
// message: the server's credentials carry an AuthMetadataProcessor that runs this check when
// the headers arrive, so a caller without credentials costs the server its headers only,
// never a buffered or parsed request body.
//
// Example:
//   auto auth = std::make_shared<CallAuthenticator>();
//   auth->Require("/lorastep.v1.Worker/", [&](const std::string& authorization) {
//     return CheckBearerToken(authorization, secret_sha256);
//   });
//   StartGrpcServer(host, port, services, &port, limit, observers, credentials, auth);
//
// Thread-safe once built: Require is called before the server starts, Check from any thread.
#ifndef LORASTEP_RPC_CALL_AUTHENTICATOR_H_
#define LORASTEP_RPC_CALL_AUTHENTICATOR_H_

#include <grpcpp/security/auth_metadata_processor.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lorastep {

class CallAuthenticator {
 public:
  // Passes (OK) or refuses (UNAUTHENTICATED, ...) a call by its "authorization" metadata.
  using CredentialCheck = std::function<absl::Status(const std::string& authorization)>;

  // Calls whose method path starts with `method_prefix` ("/lorastep.v1.Worker/") need
  // `check` to pass. The first matching prefix decides; a path no prefix matches passes
  // (grpc.health.v1, which load balancers ask without credentials).
  void Require(std::string method_prefix, CredentialCheck check) {
    rules_.emplace_back(std::move(method_prefix), std::move(check));
  }
  absl::Status Check(absl::string_view method_path, const std::string& authorization) const;
  bool empty() const { return rules_.empty(); }

 private:
  std::vector<std::pair<std::string, CredentialCheck>> rules_;
};

// The gRPC side: runs `authenticator` on every call's initial metadata (":path" and
// "authorization"), on the transport's thread (the checks are a digest compare).
std::shared_ptr<grpc::AuthMetadataProcessor> MetadataProcessorFor(std::shared_ptr<const CallAuthenticator> authenticator);

}  // namespace lorastep

#endif  // LORASTEP_RPC_CALL_AUTHENTICATOR_H_
