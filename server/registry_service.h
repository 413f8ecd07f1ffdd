// The coordinator's Registry service: remote workers announce their address; the
// coordinator connects, checks they serve the same model, and spreads new runs over them.
#ifndef LORASTEP_SERVER_REGISTRY_SERVICE_H_
#define LORASTEP_SERVER_REGISTRY_SERVICE_H_

#include "lorastep/v1/worker.grpc.pb.h"
#include "server/coordinator.h"
#include "rpc/serial_executor.h"

namespace lorastep {

class RegistryService final : public v1::Registry::CallbackService {
 public:
  explicit RegistryService(Coordinator* core) : core_(core) {}
  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterWorkerRequest* req,
                                           v1::RegisterWorkerResponse* resp) override;
  grpc::ServerUnaryReactor* JoinMesh(grpc::CallbackServerContext* ctx,
                                     const v1::JoinMeshRequest* req,
                                     v1::JoinMeshResponse* resp) override;

 private:
  Coordinator* core_;
  SerialExecutor executor_;  // connecting to a worker blocks; never on a gRPC thread
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_REGISTRY_SERVICE_H_
