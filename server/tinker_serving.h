// --tinker_port: the Tinker-compatible front (server/tinker_front.h) beside the gRPC port, on
// the same host, with the same TLS certificate and API keys, so the security policy decided for
// the Trainer API (rpc/security_policy.h) holds for it too. Its flags live here.
#ifndef LORASTEP_SERVER_TINKER_SERVING_H_
#define LORASTEP_SERVER_TINKER_SERVING_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/http_front_server.h"
#include "server/tinker_front.h"

namespace lorastep {

struct TinkerServing {
  std::unique_ptr<StateStore> store;  // the coordinator's view of the workers' store (null: none)
  std::unique_ptr<TinkerFront> front;
  std::unique_ptr<HttpFrontServer> server;  // reset before the front: it calls into it
};

// Nothing (both null) unless --tinker_port is set. `host`, `tls_cert_file`, `tls_key_file`:
// the Trainer API's --host, --tls_cert_file, --tls_key_file. Writes --tinker_port_file once
// listening.
// `state_dir`: the coordinator's state store root ("" for none), which local workers share.
// `observers`: the gRPC port's, so the front's requests are counted and logged the same way.
absl::StatusOr<TinkerServing> StartTinkerFromFlags(Coordinator* core, const ApiKeys* api_keys, Admission* admission,
                                                   const std::string& host, const std::string& tls_cert_file,
                                                   const std::string& tls_key_file, const std::string& state_dir,
                                                   const CallObservers& observers);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_SERVING_H_
