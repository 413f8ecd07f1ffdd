// The tenant a run belongs to, read from its server id. With API keys every owner's runs are
// kept as "<tag>.<id>", the tag "k" and 10 lowercase hex digits of a digest of the owner
// (server/run_names.h); without them ids carry no tag and every run is the one tenant "".
// The coordinator's and the worker's schedulers take turns by tenant before run with it.
#ifndef LORASTEP_LIB_RUN_TENANT_H_
#define LORASTEP_LIB_RUN_TENANT_H_

#include <cstddef>
#include <string>

namespace lorastep {

inline constexpr size_t kTenantPrefixBytes = 12;  // "k" + 10 hex digits + "."

// Whether `id` starts like a server id of some owner: "k", 10 lowercase hex digits, ".".
inline bool HasTenantPrefix(const std::string& id) {
  if (id.size() <= kTenantPrefixBytes || id[0] != 'k' || id[kTenantPrefixBytes - 1] != '.') return false;
  for (size_t i = 1; i + 1 < kTenantPrefixBytes; ++i) {
    const char c = id[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// The tag of the run's owner ("k0123456789"), or "" for an untagged id.
inline std::string TenantOfRun(const std::string& run_id) {
  return HasTenantPrefix(run_id) ? run_id.substr(0, kTenantPrefixBytes - 1) : std::string();
}

}  // namespace lorastep

#endif  // LORASTEP_LIB_RUN_TENANT_H_
