// API keys of the coordinator (--api_keys_file): who may call, and as whom. One key per
// line, "KEY OWNER [admin]"; '#' starts a comment. Keys are kept only as SHA-256 digests and
// compared by digest. No gRPC here: the service passes the presented key in.
#ifndef LORASTEP_SERVER_API_KEYS_H_
#define LORASTEP_SERVER_API_KEYS_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "rpc/bearer_token.h"
#include "server/coordinator.h"

namespace lorastep {

class ApiKeys {
 public:
  // INVALID_ARGUMENT naming the line for a malformed file: a key shorter than 16
  // characters, an owner outside [A-Za-z0-9_.@-], a repeated key, a third word other than
  // "admin"; NOT_FOUND if the file cannot be read; an empty file is an error too.
  static absl::StatusOr<ApiKeys> Load(const std::string& path);
  static absl::StatusOr<ApiKeys> Parse(const std::string& text, const std::string& source);
  // The caller of a presented "authorization" value ("Bearer KEY"); UNAUTHENTICATED when it
  // is missing, malformed or unknown (the message never echoes the key).
  absl::StatusOr<Caller> Authenticate(const std::string& authorization) const;
  size_t size() const { return by_digest_.size(); }

 private:
  std::map<std::string, Caller> by_digest_;  // SHA-256 hex of the key -> caller
};


}  // namespace lorastep

#endif  // LORASTEP_SERVER_API_KEYS_H_
