// The security policy over every combination of the flags that decide it, for the coordinator
// and the worker: whatever is served, the cluster's services need the secret or a client
// certificate, credentials are checked on the headers (a secure port), and a non-loopback
// Trainer API needs keys unless --insecure, which then says so. Refusals name a flag.
#include "rpc/security_policy.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lorastep {
namespace {

std::string Describe(const SecurityFlags& f) {
  return absl::StrCat(f.role == ServerRole::kCoordinator ? "coordinator" : "worker",
                      f.loopback_host ? " loopback" : " remote-host", f.tls ? " tls" : "", f.client_ca ? " client-ca" : "",
                      f.secret ? " secret" : "", f.api_keys ? " api-keys" : "", f.insecure ? " insecure" : "",
                      f.role == ServerRole::kCoordinator
                          ? (f.workers == WorkerSource::kLocal    ? " local-workers"
                             : f.workers == WorkerSource::kListed ? " listed-workers"
                                                                  : " registered-workers")
                          : "",
                      f.listed_workers_mtls ? " listed-mtls" : "");
}

std::vector<SecurityFlags> EveryCombination() {
  std::vector<SecurityFlags> all;
  for (ServerRole role : {ServerRole::kCoordinator, ServerRole::kWorker}) {
    for (int bits = 0; bits < (1 << 7); ++bits) {
      for (WorkerSource source : {WorkerSource::kLocal, WorkerSource::kListed, WorkerSource::kRegistered}) {
        SecurityFlags f;
        f.role = role;
        f.loopback_host = bits & 1;
        f.tls = bits & 2;
        f.client_ca = bits & 4;
        f.secret = bits & 8;
        f.api_keys = bits & 16;
        f.insecure = bits & 32;
        f.listed_workers_mtls = bits & 64;
        f.workers = source;
        // Flags a role does not have stay off; a coordinator with local workers always
        // holds a secret (it makes one).
        if (role == ServerRole::kWorker && (f.api_keys || f.listed_workers_mtls || source != WorkerSource::kLocal)) {
          continue;
        }
        if (role == ServerRole::kCoordinator && source == WorkerSource::kLocal && !f.secret) continue;
        all.push_back(f);
      }
    }
  }
  return all;
}

TEST(SecurityPolicyTest, NoCombinationLeavesAServiceOpen) {
  int cases = 0, open = 0, served = 0;
  for (const SecurityFlags& f : EveryCombination()) {
    ++cases;
    const std::string what = Describe(f);
    absl::StatusOr<SecurityPolicy> p = DecideSecurity(f);
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << what;
      // Names a flag: "<flag>: ..."
      const std::string flag(p.status().message().substr(0, p.status().message().find(':')));
      EXPECT_TRUE(flag == "host" || flag == "api_keys_file" || flag == "worker_token_file" || flag == "insecure" ||
                  flag == "tls_client_ca_file")
          << what << ": " << p.status();
      continue;
    }
    ++served;
    bool leak = false;
    // Credentials are checked before a body is read: only on a secure port.
    leak |= !f.loopback_host && !f.tls;
    // The cluster's own services: the secret, or a client certificate on a worker; a
    // coordinator without the secret keeps its Registry closed.
    if (f.role == ServerRole::kWorker) {
      leak |= !(p->cluster_needs_secret || p->cluster_needs_certificate);
      leak |= p->cluster_needs_certificate && !f.tls;
      leak |= f.insecure;  // a worker's --insecure opens nothing, so it is refused
    } else {
      leak |= !(p->cluster_needs_secret || p->registry_closed);
      leak |= p->cluster_needs_secret != f.secret;
      // Workers started apart authenticate with the secret (listed ones may use mutual TLS).
      leak |= f.workers == WorkerSource::kRegistered && !f.secret;
      leak |= f.workers == WorkerSource::kListed && !f.secret && !f.listed_workers_mtls;
      // The Trainer API: keys where given; off loopback without them only by --insecure, said.
      leak |= f.api_keys != p->trainer_needs_api_key;
      const bool open_trainer = !f.loopback_host && !p->trainer_needs_api_key;
      leak |= open_trainer && (!f.insecure || !absl::StrContains(p->warning, "without API keys"));
      leak |= !open_trainer && !p->warning.empty();
    }
    EXPECT_FALSE(leak) << what;
    open += leak;
  }
  EXPECT_GE(cases, 24);
  EXPECT_GE(served, 8);
  std::printf("security_policy_cases=%d\nsecurity_policy_open=%d\nsecurity_policy_served=%d\n", cases, open, served);
}

TEST(SecurityPolicyTest, TheIssuesCombinations) {
  // A coordinator with --workers and mutual TLS but no secret: it starts, its Registry closed.
  SecurityFlags f;
  f.workers = WorkerSource::kListed;
  f.listed_workers_mtls = true;
  auto p = DecideSecurity(f);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->registry_closed);
  // A worker with mutual TLS and no secret on a non-loopback host: served, no --insecure.
  SecurityFlags w;
  w.role = ServerRole::kWorker;
  w.loopback_host = false;
  w.tls = true;
  w.client_ca = true;
  p = DecideSecurity(w);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->cluster_needs_certificate);
  // --insecure on a plaintext non-loopback host: refused (no header check there).
  SecurityFlags plain;
  plain.loopback_host = false;
  plain.secret = true;
  plain.insecure = true;
  p = DecideSecurity(plain);
  EXPECT_TRUE(absl::StartsWith(p.status().message(), "host: a non-loopback host is served over TLS only")) << p.status();
  // A registering coordinator without a secret, even with --insecure.
  SecurityFlags reg;
  reg.workers = WorkerSource::kRegistered;
  reg.insecure = true;
  p = DecideSecurity(reg);
  EXPECT_TRUE(absl::StartsWith(p.status().message(), "worker_token_file:")) << p.status();
}

}  // namespace
}  // namespace lorastep
