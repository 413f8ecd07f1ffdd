#include "rpc/bearer_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "lib/io/file_util.h"

namespace lorastep {

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(data.data(), data.size(), digest, &n, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

absl::StatusOr<std::string> BearerValue(const std::string& authorization) {
  absl::string_view v = authorization;
  if (!absl::ConsumePrefix(&v, "Bearer ") || v.empty()) {
    return absl::UnauthenticatedError(
        "authorization: this coordinator requires an API key (metadata 'authorization: Bearer <key>')");
  }
  return std::string(v);
}

absl::Status CheckBearerToken(const std::string& authorization, const std::string& token_sha256) {
  auto token = BearerValue(authorization);
  if (!token.ok()) return absl::UnauthenticatedError("authorization: the worker token is required");
  const std::string digest = Sha256Hex(*token);
  if (digest.size() != token_sha256.size() ||
      CRYPTO_memcmp(digest.data(), token_sha256.data(), digest.size()) != 0) {
    return absl::UnauthenticatedError("authorization: wrong worker token");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LoadTokenFile(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("worker_token_file: cannot read '", path, "'"));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.size() < 16) {
    return absl::InvalidArgumentError(absl::StrCat("worker_token_file: '", path, "': token shorter than 16 characters"));
  }
  return token;
}

absl::StatusOr<std::string> ClusterSecretFromFileOrEnvironment(const std::string& token_file) {
  if (!token_file.empty()) return LoadTokenFile(token_file);
  const char* value = std::getenv(kClusterSecretVariable);
  if (value == nullptr) return std::string();
  std::string secret(absl::StripAsciiWhitespace(value));
  if (secret.size() < 16) {
    return absl::InvalidArgumentError(
        absl::StrCat(kClusterSecretVariable, ": the cluster secret is shorter than 16 characters"));
  }
  return secret;
}

absl::StatusOr<std::string> NewClusterSecret() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    return absl::InternalError("cluster secret: OpenSSL's random generator failed");
  }
  return Sha256Hex(std::string(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

std::string RendezvousKeyPrefix(const std::string& secret) {
  return Sha256Hex(absl::StrCat("lorastep-rendezvous-v1/", secret)).substr(0, 32);
}

}  // namespace lorastep
