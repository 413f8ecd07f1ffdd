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

}  // namespace lorastep

#endif  // LORASTEP_RPC_BEARER_TOKEN_H_
