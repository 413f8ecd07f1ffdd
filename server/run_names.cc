#include "server/run_names.h"

#include <cctype>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "lib/io/state_store.h"
#include "rpc/bearer_token.h"

namespace lorastep {
namespace {

constexpr size_t kPrefixBytes = 12;  // "k" + 10 hex digits + "."

// Whether `id` starts like a server id of some owner: "k", 10 lowercase hex digits, ".".
bool HasOwnerPrefix(const std::string& id) {
  if (id.size() <= kPrefixBytes || id[0] != 'k' || id[kPrefixBytes - 1] != '.') return false;
  for (size_t i = 1; i + 1 < kPrefixBytes; ++i) {
    const char c = id[i];
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  }
  return true;
}

// Applies `map` to the run of a lorastep://<run>/<name> reference.
template <typename Map>
std::string MapRef(const std::string& path, Map map) {
  if (!absl::StartsWith(path, kStateRefScheme)) return path;
  const size_t start = sizeof(kStateRefScheme) - 1;
  const size_t slash = path.find('/', start);
  const std::string run = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
  return absl::StrCat(kStateRefScheme, map(run), slash == std::string::npos ? "" : path.substr(slash));
}

}  // namespace

std::string OwnerRunPrefix(const std::string& owner) {
  if (owner.empty()) return "";
  return absl::StrCat("k", Sha256Hex(owner).substr(0, kPrefixBytes - 2), ".");
}

std::string ServerRunId(const Caller& caller, const std::string& id) {
  if (caller.owner.empty() || id.empty()) return id;
  if (caller.admin && HasOwnerPrefix(id)) return id;
  return OwnerRunPrefix(caller.owner) + id;
}

std::string ClientRunId(const Caller& caller, const std::string& server_id) {
  const std::string prefix = OwnerRunPrefix(caller.owner);
  if (prefix.empty() || !absl::StartsWith(server_id, prefix)) return server_id;
  return server_id.substr(prefix.size());
}

std::string ServerRef(const Caller& caller, const std::string& path) {
  return MapRef(path, [&](const std::string& run) { return ServerRunId(caller, run); });
}

std::string ClientRef(const Caller& caller, const std::string& path) {
  return MapRef(path, [&](const std::string& run) { return ClientRunId(caller, run); });
}

absl::Status ClientStatus(const Caller& caller, const absl::Status& status) {
  if (status.ok() || caller.owner.empty()) return status;
  const std::string prefix = OwnerRunPrefix(caller.owner);
  if (!absl::StrContains(status.message(), prefix)) return status;
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(), {{prefix, ""}}));
}

void HideOtherTenantsFigures(const Caller& caller, google::protobuf::Map<std::string, double>* metrics) {
  if (caller.admin) return;
  for (const char* name : {"co_scheduled_tokens:max", "co_scheduled_row_tokens:max"}) metrics->erase(name);
}

}  // namespace lorastep
