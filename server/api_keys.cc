#include "server/api_keys.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "lib/io/file_util.h"
#include "rpc/bearer_token.h"

namespace lorastep {

namespace {

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

}  // namespace lorastep
