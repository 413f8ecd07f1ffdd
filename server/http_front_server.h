// The Tinker-compatible front's HTTP server (--tinker_port): GNU libmicrohttpd, chosen for
// its suspend/resume of connections on a fixed pool of threads: a long-polled
// retrieve_future waits as a suspended connection, not as a blocked thread, so a thousand
// idle polls cost memory only. A thin adapter: it reads a request under the front's limits
// and hands it to TinkerFront (server/tinker_front.h).
//
// Before a body is read: the route must be under /api/v1/, the X-API-Key must be known (when
// keys are configured), the declared length within the limit, and the caller's key admitted
// (server/admission.h); a refusal is answered at once and the body is never read. A body
// sent with Content-Encoding: zstd is decompressed within the same limit.
#ifndef LORASTEP_SERVER_HTTP_FRONT_SERVER_H_
#define LORASTEP_SERVER_HTTP_FRONT_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "rpc/server_runner.h"
#include "server/tinker_front.h"

struct MHD_Daemon;

namespace lorastep {

struct HttpFrontOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port (see port())
  // TLS (PEM): both or neither; the Trainer API's --tls_cert_file / --tls_key_file.
  std::string tls_cert_pem, tls_key_pem;
  int64_t max_body_bytes = int64_t{64} << 20;  // one request's body, decoded (--tinker_max_request_mb)
  int threads = 4;
  int max_connections = 4096;
  // Each answered request counted, timed and logged as a gRPC call is (method
  // "Tinker/<route>", the HTTP status as its code; rpc/server_runner.h).
  CallObservers observers;
};

class HttpFrontServer {
 public:
  // Listens at once; INVALID_ARGUMENT naming the option that is wrong, UNAVAILABLE when the
  // port cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpFrontServer>> Start(TinkerFront* front, HttpFrontOptions options);
  // Answers every request still waiting (held polls try_again, calls in progress 503), then
  // stops; the front must be destroyed after this.
  ~HttpFrontServer();
  int port() const { return port_; }

 private:
  struct Suspended;
  HttpFrontServer(TinkerFront* front, HttpFrontOptions options);
  TinkerFront* front_;
  HttpFrontOptions options_;
  std::shared_ptr<Suspended> suspended_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  friend struct HttpFrontCalls;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_HTTP_FRONT_SERVER_H_
