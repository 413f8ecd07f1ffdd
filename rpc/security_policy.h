// Who may reach what, decided once from all of a server's security flags before anything
// listens, and the same for the coordinator and the worker:
//  - the cluster's own services (the coordinator's Registry: RegisterWorker, JoinMesh; every
//    Worker and RendezvousStore method) need the cluster secret or, on a worker, a client
//    certificate its CA signed (mutual TLS). Nothing opens them: a coordinator without a
//    secret keeps its Registry closed, and a worker without either does not start.
//  - credentials are checked on a call's headers before its message is read. gRPC runs that
//    check only on a secure port (TLS, or its local credentials on a loopback host), so a
//    non-loopback host is served over TLS only.
//  - the Trainer API on a non-loopback host needs API keys, unless --insecure, which opens
//    exactly that (and says so).
// Pure logic, no gRPC: the binaries turn the decision into credentials and header checks.
#ifndef LORASTEP_RPC_SECURITY_POLICY_H_
#define LORASTEP_RPC_SECURITY_POLICY_H_

#include <string>

#include "absl/status/statusor.h"

namespace lorastep {

enum class ServerRole { kCoordinator, kWorker };

// How the coordinator gets its workers.
enum class WorkerSource {
  kLocal,       // it starts them (it makes a secret and hands it over)
  kListed,      // --workers
  kRegistered,  // --wait_for_workers
};

struct SecurityFlags {
  ServerRole role = ServerRole::kCoordinator;
  bool loopback_host = true;   // --host is a loopback address
  bool tls = false;            // --tls_cert_file/--tls_key_file
  bool client_ca = false;      // worker: --tls_client_ca_file (callers need a certificate it signed)
  bool secret = false;         // the cluster secret is held (file, environment, or made for local workers)
  bool api_keys = false;       // coordinator: --api_keys_file
  bool insecure = false;       // --insecure
  // Coordinator only:
  WorkerSource workers = WorkerSource::kLocal;
  bool listed_workers_mtls = false;  // --worker_tls_client_cert_file: it presents a certificate to listed workers
};

struct SecurityPolicy {
  bool trainer_needs_api_key = false;      // coordinator: every Trainer call and reflection
  bool cluster_needs_secret = false;       // Registry / Worker / RendezvousStore calls need the secret
  bool cluster_needs_certificate = false;  // worker: the TLS handshake requires a client certificate
  bool registry_closed = false;            // coordinator without a secret: the Registry refuses every call
  std::string warning;                     // what --insecure opened, for the start-up log; empty: nothing
};

// INVALID_ARGUMENT naming the flag to set when the combination would leave a service open or
// the header check off; else the policy the server applies.
absl::StatusOr<SecurityPolicy> DecideSecurity(const SecurityFlags& flags);

}  // namespace lorastep

#endif  // LORASTEP_RPC_SECURITY_POLICY_H_
