#include "server/run_names.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "lib/io/state_store.h"
#include "lib/run_tenant.h"
#include "rpc/bearer_token.h"

namespace lorastep {
namespace {

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
  return absl::StrCat("k", Sha256Hex(owner).substr(0, kTenantPrefixBytes - 2), ".");
}

std::string ServerRunId(const Caller& caller, const std::string& id) {
  if (caller.owner.empty() || id.empty()) return id;
  if (caller.admin && HasTenantPrefix(id)) return id;
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
