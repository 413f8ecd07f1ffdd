#include "lib/io/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {

namespace {

// Whether `path` may be replaced: absent, an empty folder, or a folder lorastep wrote.
absl::Status CheckReplaceable(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // absent
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": exists and is not a folder; lorastep only replaces folders it wrote"));
  }
  if (PathExists(path + "/" + kFolderMarker)) return absl::OkStatus();
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return ErrnoError("cannot open", path);
  bool empty = true;
  while (dirent* e = readdir(dir)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) empty = false;
  }
  closedir(dir);
  if (empty) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      path, ": exists and was not written by lorastep (no ", kFolderMarker,
      " marker); refusing to replace it: choose another path or remove it"));
}

}  // namespace

absl::Status WriteFolderAtomically(
    const std::string& folder, const std::function<absl::Status(const std::string&)>& write_files,
    const std::function<absl::Status(const std::string& stage)>& fault_point) {
  std::string target = folder;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  LORASTEP_RETURN_IF_ERROR(CheckReplaceable(target));  // before anything is written
  const std::string parent = ParentPath(target);
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(parent));
  // A fresh, uniquely named sibling: nothing that already exists is ever removed.
  std::string pattern = absl::StrCat(target, ".tmp-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return ErrnoError("cannot create", pattern);
  const std::string tmp = pattern;
  // A failure removes the temporary folder; a simulated crash (fault_point) leaves it, as a
  // real crash would.
  auto fail = [&](absl::Status status) {
    RemoveAll(tmp).IgnoreError();
    return status;
  };
  if (absl::Status s = write_files(tmp); !s.ok()) return fail(s);
  if (absl::Status s = WriteStringToFile(tmp + "/" + kFolderMarker, "written by lorastep\n"); !s.ok()) return fail(s);
  if (absl::Status s = SyncDirectory(tmp); !s.ok()) return fail(s);
  if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("files_written"));
  if (PathExists(target)) {
    if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("before_swap"));
    if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      return fail(ErrnoError("atomic exchange failed", folder));
    }
    LORASTEP_RETURN_IF_ERROR(SyncDirectory(parent));
    return RemoveAll(tmp);  // now holds the previous checkpoint (written by lorastep)
  }
  if (rename(tmp.c_str(), target.c_str()) != 0) return fail(ErrnoError("rename failed", folder));
  return SyncDirectory(parent);
}

}  // namespace lorastep
