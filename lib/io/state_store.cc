#include "lib/io/state_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lib/io/checkpoint_dir.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {

std::string DefaultStateDir() {
  if (const char* xdg = std::getenv("XDG_STATE_HOME"); xdg != nullptr && xdg[0] == '/') {
    return absl::StrCat(xdg, "/lorastep");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] == '/' && home[1] != '\0') {
    return absl::StrCat(home, "/.local/state/lorastep");
  }
  return absl::StrCat("/tmp/lorastep-state-", getuid());
}

absl::StatusOr<std::string> ServerStateDir(const std::string& state_dir_flag, bool allow_plain_paths) {
  if (allow_plain_paths) {
    if (!state_dir_flag.empty()) {
      return absl::InvalidArgumentError(
          "allow_plain_paths: cannot be combined with --state_dir (plain paths mean no state store)");
    }
    return std::string();
  }
  return state_dir_flag.empty() ? DefaultStateDir() : state_dir_flag;
}
namespace {

// Bytes of the regular files under `path` and the newest modification time.
void Measure(const std::string& path, int64_t* bytes, int64_t* newest) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;
  *newest = std::max<int64_t>(*newest, st.st_mtime);
  if (S_ISREG(st.st_mode)) {
    *bytes += st.st_size;
    return;
  }
  if (!S_ISDIR(st.st_mode)) return;
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    Measure(path + "/" + e->d_name, bytes, newest);
  }
  closedir(dir);
}

}  // namespace

absl::Status ValidateStoreName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  if (name.size() > kMaxStoreNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", name.size(), " bytes; at most ", kMaxStoreNameBytes));
  }
  if (name.front() == '.') {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not start with '.'"));
  }
  if (absl::StrContains(name, ".tmp-")) {  // the pattern of lorastep's folders being written
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not contain '.tmp-'"));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": only letters, digits, '.', '_' and '-' are allowed (found byte ",
          static_cast<int>(static_cast<unsigned char>(c)), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StateStore> StateStore::Open(const std::string& root) {
  if (root.empty()) return absl::InvalidArgumentError("state_dir: required");
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(root + "/runs"));
  const std::string id_file = root + "/store_id";
  if (!PathExists(id_file)) {
    // Written aside and linked into place: of several servers opening a new root at once,
    // one id wins and every one reads it.
    std::random_device device;
    const std::string id = absl::StrFormat("%08x%08x%08x%08x", device(), device(), device(), device());
    const std::string tmp = absl::StrCat(id_file, ".", id);
    LORASTEP_RETURN_IF_ERROR(WriteStringToFile(tmp, id + "\n"));
    const int linked = link(tmp.c_str(), id_file.c_str());
    const int link_errno = errno;
    unlink(tmp.c_str());
    if (linked != 0 && link_errno != EEXIST) {
      errno = link_errno;
      return ErrnoError("cannot create", id_file);
    }
  }
  LORASTEP_ASSIGN_OR_RETURN(std::string id, ReadFileToString(id_file));
  return StateStore(root, std::string(absl::StripAsciiWhitespace(id)));
}

std::string StateStore::RunFolder(absl::string_view run) const {
  return absl::StrCat(root_, "/runs/", run);
}

absl::StatusOr<std::string> StateStore::Resolve(absl::string_view ref, absl::string_view field) const {
  if (!absl::StartsWith(ref, kStateRefScheme)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be a ", kStateRefScheme, "<run>/<name> reference (this server keeps state in its store, --state_dir; plain paths need --allow_plain_paths)"));
  }
  const absl::string_view rest = ref.substr(std::strlen(kStateRefScheme));
  const size_t slash = rest.find('/');
  if (slash == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", kStateRefScheme, "<run>/<name>"));
  }
  LORASTEP_RETURN_IF_ERROR(ValidateStoreName(rest.substr(0, slash), absl::StrCat(field, " (run)")));
  LORASTEP_RETURN_IF_ERROR(ValidateStoreName(rest.substr(slash + 1), absl::StrCat(field, " (name)")));
  // A symbolic link in the store (runs/<run> or the named folder) would lead reads and
  // writes outside the root: the store holds real folders only.
  const std::string run_folder = RunFolder(rest.substr(0, slash));
  const std::string path = absl::StrCat(run_folder, "/", rest.substr(slash + 1));
  for (const std::string& p : {run_folder, path}) {
    struct stat st;
    if (lstat(p.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": ", ref, " passes through a symbolic link in the state store; only real folders are used"));
    }
  }
  return path;
}

absl::StatusOr<std::vector<StoredFolder>> StateStore::List(absl::string_view run) const {
  LORASTEP_RETURN_IF_ERROR(ValidateStoreName(run, "run_id"));
  std::vector<StoredFolder> out;
  const std::string folder = RunFolder(run);
  DIR* dir = opendir(folder.c_str());
  if (dir == nullptr) {
    if (errno == ENOENT) return out;
    return ErrnoError("cannot list", folder);
  }
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (!ValidateStoreName(name, "").ok()) continue;  // ".", "..", temporary folders
    const std::string path = folder + "/" + name;
    if (!PathExists(path + "/" + kFolderMarker)) continue;
    StoredFolder f;
    f.name = name;
    f.ref = StateRef(run, name);
    Measure(path, &f.bytes, &f.modified_unix_s);
    out.push_back(std::move(f));
  }
  closedir(dir);
  std::sort(out.begin(), out.end(), [](const StoredFolder& a, const StoredFolder& b) { return a.name < b.name; });
  return out;
}

absl::Status StateStore::Delete(absl::string_view run, absl::string_view name) const {
  LORASTEP_RETURN_IF_ERROR(ValidateStoreName(run, "run_id"));
  LORASTEP_RETURN_IF_ERROR(ValidateStoreName(name, "name"));
  const std::string path = absl::StrCat(RunFolder(run), "/", name);
  if (!PathExists(path)) {
    return absl::NotFoundError(absl::StrCat("name: ", kStateRefScheme, run, "/", name, " does not exist"));
  }
  if (!PathExists(path + "/" + kFolderMarker)) {
    return absl::FailedPreconditionError(absl::StrCat("name: ", path, " was not written by lorastep; not removed"));
  }
  return RemoveAll(path);
}

absl::StatusOr<std::vector<std::string>> StateStore::PruneOlderThan(int64_t max_age_s, int64_t now_unix_s) const {
  std::vector<std::string> removed;
  const std::string runs = root_ + "/runs";
  DIR* dir = opendir(runs.c_str());
  if (dir == nullptr) {
    if (errno == ENOENT) return removed;
    return ErrnoError("cannot list", runs);
  }
  std::vector<std::string> run_ids;
  while (dirent* e = readdir(dir)) {
    if (ValidateStoreName(e->d_name, "").ok()) run_ids.push_back(e->d_name);
  }
  closedir(dir);
  for (const std::string& run : run_ids) {
    LORASTEP_ASSIGN_OR_RETURN(std::vector<StoredFolder> folders, List(run));
    for (const StoredFolder& f : folders) {
      if (now_unix_s - f.modified_unix_s <= max_age_s) continue;
      LORASTEP_RETURN_IF_ERROR(Delete(run, f.name));
      removed.push_back(f.ref);
    }
  }
  return removed;
}

absl::StatusOr<std::string> ResolveRequestPath(const StateStore* store, const std::string& path,
                                               absl::string_view field) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  if (store != nullptr) return store->Resolve(path, field);
  if (absl::StartsWith(path, kStateRefScheme)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", kStateRefScheme, " references need a state store (this server was started with --allow_plain_paths)"));
  }
  // A plain path names one folder the client means, on the worker's machine: relative paths
  // (resolved against the worker's own working folder) and "." / ".." components (which
  // climb out of wherever the client thought it wrote) are refused, as are NUL bytes (the
  // file system would see a shorter path than the one checked).
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": contains a NUL byte"));
  }
  if (path.size() > 4096) return absl::InvalidArgumentError(absl::StrCat(field, ": longer than 4096 bytes"));
  if (path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(field, ": '", path, "' is relative; give an absolute path (or a ",
                                                   kStateRefScheme, "<run>/<name> reference to a server with a state store)"));
  }
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part == "." || part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(field, ": '", path, "' has a '", part, "' component"));
    }
  }
  return path;
}

}  // namespace lorastep
