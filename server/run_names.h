// Run ids per API key owner. With --api_keys_file every owner has its own run-id namespace:
// alice's "alpha" and bob's "alpha" are two runs, and neither learns the other exists (a
// client-chosen id taken by another owner used to answer ALREADY_EXISTS). Clients keep
// naming their runs as they chose them; the server keeps them as "<tag>.<id>", the tag a
// digest of the owner ("k" and 10 hex digits), in its registry, journal, workers, state
// store folders and metrics labels. Admin keys see other owners' runs under those server
// ids and name them so. Without API keys (owner "") ids are kept as they are.
// CoordinatorService translates at the API's edge, requests in and responses out.
#ifndef LORASTEP_SERVER_RUN_NAMES_H_
#define LORASTEP_SERVER_RUN_NAMES_H_

#include <string>

#include <google/protobuf/map.h>

#include "absl/status/status.h"

#include "server/coordinator.h"

namespace lorastep {

// "k" + the first 10 hex digits of SHA-256(owner), then "."; "" for owner "".
std::string OwnerRunPrefix(const std::string& owner);
// The server's id of the run `caller` names `id`. An admin naming a server id of another
// owner's run (a prefixed id, as ListRuns shows it) gets it as it is.
std::string ServerRunId(const Caller& caller, const std::string& id);
// The id `caller` knows the run `server_id` by: without the caller's own prefix.
std::string ClientRunId(const Caller& caller, const std::string& server_id);
// A path field: a lorastep://<run>/<name> reference with its run translated like a run id;
// anything else as it is.
std::string ServerRef(const Caller& caller, const std::string& path);
std::string ClientRef(const Caller& caller, const std::string& path);
// `status` with the caller's own runs named as the caller knows them: the core's messages
// name server ids ("run_id: 'k0123456789.alpha' exists", lorastep://k0123456789.alpha/ck).
absl::Status ClientStatus(const Caller& caller, const absl::Status& status);

// A co-scheduled step's figures that count other runs' tokens (`co_scheduled_tokens:max`,
// `co_scheduled_row_tokens:max`: other tenants' batch sizes) are dropped from what a caller
// without an admin key sees; the counts of runs that shared the step stay. Operators keep
// every figure in Prometheus. Without API keys every caller is an admin.
void HideOtherTenantsFigures(const Caller& caller, google::protobuf::Map<std::string, double>* metrics);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_RUN_NAMES_H_
