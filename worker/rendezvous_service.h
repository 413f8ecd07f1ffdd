// The RendezvousStore gRPC adapter over rank 0's RendezvousStoreHost, and the transport the
// other ranks of a mesh across hosts reach it by. The service runs on the server's own
// credentials and CallAuthenticator (the cluster secret), so only members rendezvous.
#ifndef LORASTEP_WORKER_RENDEZVOUS_SERVICE_H_
#define LORASTEP_WORKER_RENDEZVOUS_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "lib/parallel/rendezvous_store.h"
#include "lorastep/v1/worker.grpc.pb.h"

namespace lorastep {

class RendezvousStoreService final : public v1::RendezvousStore::CallbackService {
 public:
  explicit RendezvousStoreService(RendezvousStoreHost* host) : host_(host) {}
  // Answered on the gRPC thread: the host never blocks.
  grpc::ServerUnaryReactor* Apply(grpc::CallbackServerContext* ctx, const v1::StoreOpRequest* req,
                                  v1::StoreOpResponse* resp) override;

 private:
  RendezvousStoreHost* host_;
};

// Store operations as RendezvousStore.Apply calls to `address` with `authorization` (the
// cluster secret's bearer header; empty: none).
StoreTransport GrpcStoreTransport(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                                  std::string authorization);

}  // namespace lorastep

#endif  // LORASTEP_WORKER_RENDEZVOUS_SERVICE_H_
