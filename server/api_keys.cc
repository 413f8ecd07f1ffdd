#include "server/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

namespace {

absl::StatusOr<std::string> BearerValue(const std::string& authorization) {
  absl::string_view v = authorization;
  if (!absl::ConsumePrefix(&v, "Bearer ") || v.empty()) {
    return absl::UnauthenticatedError(
        "authorization: this coordinator requires an API key (metadata 'authorization: Bearer <key>')");
  }
  return std::string(v);
}

bool PlainOwner(const std::string& s) {
  return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '@' || c == '-';
  });
}

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::Parse(const std::string& text, const std::string& source) {
  ApiKeys keys;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = line.substr(0, line.find('#'));
    std::vector<std::string> words = absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    const std::string where = absl::StrCat(source, ":", line_no, ": ");
    if (words.size() < 2 || words.size() > 3 || (words.size() == 3 && words[2] != "admin")) {
      return absl::InvalidArgumentError(absl::StrCat(where, "expected 'KEY OWNER [admin]'"));
    }
    if (words[0].size() < 16) return absl::InvalidArgumentError(absl::StrCat(where, "key shorter than 16 characters"));
    if (!PlainOwner(words[1])) {
      return absl::InvalidArgumentError(absl::StrCat(where, "owner must be 1-64 characters of [A-Za-z0-9_.@-]"));
    }
    const std::string digest = Sha256Hex(words[0]);
    if (keys.by_digest_.count(digest)) return absl::InvalidArgumentError(absl::StrCat(where, "repeated key"));
    keys.by_digest_[digest] = Caller{words[1], words.size() == 3};
  }
  if (keys.by_digest_.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no keys"));
  return keys;
}

absl::StatusOr<ApiKeys> ApiKeys::Load(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("api_keys_file: cannot read '", path, "'"));
  return Parse(*text, path);
}

absl::StatusOr<Caller> ApiKeys::Authenticate(const std::string& authorization) const {
  auto key = BearerValue(authorization);
  if (!key.ok()) return key.status();
  auto it = by_digest_.find(Sha256Hex(*key));
  if (it == by_digest_.end()) return absl::UnauthenticatedError("authorization: unknown API key");
  return it->second;
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

}  // namespace lorastep
