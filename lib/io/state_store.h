// The server's state store: checkpoints and adapter exports under one server-configured root
// (`--state_dir`), addressed by clients as `lorastep://<run>/<name>` references instead of
// file-system paths. Names are validated (no '/', "..", NUL, hidden names; length cap), the
// same rules apply to run ids, and only folders lorastep wrote (marked, see checkpoint_dir.h)
// are listed or deleted.
#ifndef LORASTEP_LIB_IO_STATE_STORE_H_
#define LORASTEP_LIB_IO_STATE_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace lorastep {

inline constexpr char kStateRefScheme[] = "lorastep://";
// The reference lorastep://<run>/<name>.
inline std::string StateRef(absl::string_view run, absl::string_view name) {
  return absl::StrCat(kStateRefScheme, run, "/", name);
}
inline constexpr size_t kMaxStoreNameBytes = 128;

// A run id or stored name: 1-128 bytes of [A-Za-z0-9._-], not starting with '.'.
// INVALID_ARGUMENT naming `field` otherwise.
absl::Status ValidateStoreName(absl::string_view name, absl::string_view field);

// Where a server keeps its state store when --state_dir is not given:
// $XDG_STATE_HOME/lorastep, else $HOME/.local/state/lorastep, else /tmp/lorastep-state-<uid>.
std::string DefaultStateDir();
// The state store root a server runs with, from its --state_dir and --allow_plain_paths
// flags: the given root, DefaultStateDir() when none is given, or "" (no store: path fields
// are plain absolute paths, for trusted clients only) with --allow_plain_paths, which is
// INVALID_ARGUMENT together with a --state_dir.
absl::StatusOr<std::string> ServerStateDir(const std::string& state_dir_flag, bool allow_plain_paths);

struct StoredFolder {
  std::string name;
  std::string ref;  // lorastep://<run>/<name>
  int64_t bytes = 0;
  int64_t modified_unix_s = 0;
};

class StateStore {
 public:
  // Creates `root` if needed, and its identity (`<root>/store_id`, random, made by the first
  // server that opens the root).
  static absl::StatusOr<StateStore> Open(const std::string& root);

  // The same for every server that opens this root, whatever path it was opened by: the ranks
  // of a mesh compare it to know they share one store (rank 0 writes what all ranks load).
  const std::string& id() const { return id_; }

  // The folder a `lorastep://<run>/<name>` reference names: <root>/runs/<run>/<name>.
  absl::StatusOr<std::string> Resolve(absl::string_view ref, absl::string_view field) const;
  // lorastep's folders of a run, by name (an unknown run has none).
  absl::StatusOr<std::vector<StoredFolder>> List(absl::string_view run) const;
  // Removes one of them; NOT_FOUND when absent, FAILED_PRECONDITION when not lorastep's.
  absl::Status Delete(absl::string_view run, absl::string_view name) const;
  // Removes every run's lorastep folders whose newest file is older than `max_age_s` at
  // `now_unix_s` (the store's TTL, --state_ttl_hours); foreign folders and temporary ones are
  // left. Returns the references removed.
  absl::StatusOr<std::vector<std::string>> PruneOlderThan(int64_t max_age_s, int64_t now_unix_s) const;
  const std::string& root() const { return root_; }

 private:
  StateStore(std::string root, std::string id) : root_(std::move(root)), id_(std::move(id)) {}
  std::string RunFolder(absl::string_view run) const;
  std::string root_;
  std::string id_;
};

// What a request's `path` field means on this server: with a store, a reference resolved in
// it (plain paths refused); without one, a plain path (references refused).
absl::StatusOr<std::string> ResolveRequestPath(const StateStore* store, const std::string& path,
                                               absl::string_view field);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_STATE_STORE_H_
