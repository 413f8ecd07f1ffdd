#include "rpc/security_policy.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lorastep {

absl::StatusOr<SecurityPolicy> DecideSecurity(const SecurityFlags& f) {
  const bool coordinator = f.role == ServerRole::kCoordinator;
  const char* who = coordinator ? "coordinator" : "worker";
  // The header check needs a secure port: gRPC's local credentials on loopback, TLS elsewhere.
  if (!f.loopback_host && !f.tls) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host: a non-loopback host is served over TLS only (--tls_cert_file/--tls_key_file): credentials are checked "
        "on a call's headers before its message is read, which gRPC does only on a secure port",
        f.insecure ? "; --insecure does not lift this" : ""));
  }
  if (f.client_ca && (coordinator || !f.tls)) {
    return absl::InvalidArgumentError(coordinator ? "tls_client_ca_file: a coordinator's callers use API keys"
                                                  : "tls_client_ca_file: needs --tls_cert_file/--tls_key_file");
  }
  SecurityPolicy p;
  if (coordinator) {
    if (!f.secret) {
      // Workers started apart from this coordinator prove themselves with the secret; a
      // registered one has nothing else. Listed workers may verify this coordinator's
      // certificate instead; the Registry then admits no one.
      if (f.workers == WorkerSource::kRegistered ||
          (f.workers == WorkerSource::kListed && !f.listed_workers_mtls)) {
        return absl::InvalidArgumentError(
            "worker_token_file: workers started apart from this coordinator must share a cluster secret with it "
            "(--worker_token_file FILE or $LORASTEP_CLUSTER_SECRET on every process), or, for --workers, verify it "
            "by mutual TLS (--worker_tls_client_cert_file); --insecure does not lift this");
      }
      p.registry_closed = true;
    }
    p.cluster_needs_secret = f.secret;
    if (f.api_keys) {
      p.trainer_needs_api_key = true;
    } else if (!f.loopback_host) {
      if (!f.insecure) {
        return absl::InvalidArgumentError(
            "api_keys_file: a non-loopback host needs API keys (--api_keys_file); on a trusted network only, "
            "--insecure serves the Trainer API there without them");
      }
      p.warning = "--insecure: the Trainer API is served without API keys to anyone who reaches this host (over "
                  "TLS); the Registry still needs the cluster secret";
    }
  } else {
    if (!f.secret && !f.client_ca) {
      return absl::InvalidArgumentError(
          "worker_token_file: a worker's calls need the cluster secret its coordinator holds (--worker_token_file "
          "FILE or $LORASTEP_CLUSTER_SECRET), or mutual TLS (--tls_client_ca_file); --insecure does not lift this");
    }
    p.cluster_needs_secret = f.secret;
    p.cluster_needs_certificate = f.client_ca;
    if (f.insecure) {
      return absl::InvalidArgumentError(absl::StrCat(
          "insecure: opens nothing on a ", who, " (its calls always need the cluster secret or a client certificate, "
          "and a non-loopback host TLS); remove the flag"));
    }
  }
  return p;
}

}  // namespace lorastep
