#include "lib/io/checkpoint_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {

absl::Status WriteFolderAtomically(
    const std::string& folder, const std::function<absl::Status(const std::string&)>& write_files,
    const std::function<absl::Status(const std::string& stage)>& fault_point) {
  std::string target = folder;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  const std::string parent = ParentPath(target);
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(parent));
  const std::string tmp = absl::StrCat(target, ".tmp-", getpid());
  LORASTEP_RETURN_IF_ERROR(RemoveAll(tmp));
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(tmp));
  LORASTEP_RETURN_IF_ERROR(write_files(tmp));
  LORASTEP_RETURN_IF_ERROR(SyncDirectory(tmp));
  if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("files_written"));
  if (PathExists(target)) {
    if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("before_swap"));
    if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      return absl::InternalError(
          absl::StrCat(folder, ": atomic exchange failed: ", std::strerror(errno)));
    }
    LORASTEP_RETURN_IF_ERROR(SyncDirectory(parent));
    return RemoveAll(tmp);  // now holds the previous checkpoint
  }
  if (rename(tmp.c_str(), target.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(folder, ": rename failed: ", std::strerror(errno)));
  }
  return SyncDirectory(parent);
}

}  // namespace lorastep
