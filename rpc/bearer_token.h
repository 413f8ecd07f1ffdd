// "authorization: Bearer <secret>" metadata: the API keys' and the worker token's common
// parts. No gRPC types: callers pass the metadata value in.
#ifndef LORASTEP_RPC_BEARER_TOKEN_H_
#define LORASTEP_RPC_BEARER_TOKEN_H_

#include <string>

#include "absl/status/statusor.h"

namespace lorastep {

std::string Sha256Hex(const std::string& data);
// The secret of an "authorization" value; UNAUTHENTICATED when missing or not "Bearer ...".
absl::StatusOr<std::string> BearerValue(const std::string& authorization);
// The shared worker token (--worker_token_file) the coordinator and workers present to each
// other: UNAUTHENTICATED on mismatch (compared by digest, in constant time).
absl::Status CheckBearerToken(const std::string& authorization, const std::string& token_sha256);
absl::StatusOr<std::string> LoadTokenFile(const std::string& path);  // the token, trimmed; >= 16 chars

// The cluster secret: the worker token every member of a cluster holds. The coordinator and
// its workers present it to each other on every Worker and Registry call. It reaches a
// process through --worker_token_file or this environment variable (local workers get the
// coordinator's through their environment), never on a command line.
inline constexpr char kClusterSecretVariable[] = "LORASTEP_CLUSTER_SECRET";
// The secret from `token_file` (the --worker_token_file flag) when set, else from
// $LORASTEP_CLUSTER_SECRET, else "" (none given). INVALID_ARGUMENT naming the flag or the
// variable when shorter than 16 characters.
absl::StatusOr<std::string> ClusterSecretFromFileOrEnvironment(const std::string& token_file);
// 32 random bytes from OpenSSL's generator, as 64 hex digits.
absl::StatusOr<std::string> NewClusterSecret();
// The key prefix ranks put before every rendezvous-store key: derived from the secret, so a
// caller that reaches the store without it cannot name (read or overwrite) the mesh's keys.
std::string RendezvousKeyPrefix(const std::string& secret);

}  // namespace lorastep

#endif  // LORASTEP_RPC_BEARER_TOKEN_H_
