// The coordinator's Registry service: remote workers announce their address; the
// coordinator connects, checks they serve the same model, and spreads new runs over them.
#ifndef LORASTEP_SERVER_REGISTRY_SERVICE_H_
#define LORASTEP_SERVER_REGISTRY_SERVICE_H_

#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/bearer_token.h"
#include "server/coordinator.h"
#include "server/grpc_worker_client.h"
#include "rpc/serial_executor.h"

namespace lorastep {

class RegistryService final : public v1::Registry::CallbackService {
 public:
  // `worker_token`: with --worker_token_file, registering and joining need it (and the
  // coordinator presents it to the registered worker); empty: open.
  // `worker_tls`: registered workers serve TLS (see WorkerTls).
  explicit RegistryService(Coordinator* core, std::string worker_token = "", WorkerTls worker_tls = {})
      : core_(core), worker_token_(std::move(worker_token)),
        token_sha256_(worker_token_.empty() ? "" : Sha256Hex(worker_token_)),
        worker_tls_(std::move(worker_tls)) {}
  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterWorkerRequest* req,
                                           v1::RegisterWorkerResponse* resp) override;
  grpc::ServerUnaryReactor* JoinMesh(grpc::CallbackServerContext* ctx,
                                     const v1::JoinMeshRequest* req,
                                     v1::JoinMeshResponse* resp) override;

 private:
  absl::Status CheckToken(grpc::CallbackServerContext* ctx) const;
  Coordinator* core_;
  std::string worker_token_, token_sha256_;
  WorkerTls worker_tls_;
  SerialExecutor executor_;  // connecting to a worker blocks; never on a gRPC thread
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_REGISTRY_SERVICE_H_
