// Atomic replacement of a checkpoint folder: files are written into a sibling temporary
// folder and fsynced, then the folder is swapped in with one rename (renameat2 EXCHANGE when
// the target exists). A crash at any point leaves either the old or the new folder whole.
#ifndef LORASTEP_LIB_IO_CHECKPOINT_DIR_H_
#define LORASTEP_LIB_IO_CHECKPOINT_DIR_H_

#include <functional>
#include <string>

#include "absl/status/status.h"

namespace lorastep {

// Every folder written here carries this marker file; an existing folder without it (and not
// empty), or a file, at the target is never replaced: FAILED_PRECONDITION before any write.
inline constexpr char kFolderMarker[] = ".lorastep";

// `write_files(tmp_folder)` writes the contents into a fresh uniquely named sibling folder;
// any failure removes that folder again. `fault_point` (tests only) is called with a
// stage name ("files_written", "before_swap") and may return an error to simulate a crash
// there: the temporary folder is then left behind, exactly as a crash would leave it.
absl::Status WriteFolderAtomically(
    const std::string& folder, const std::function<absl::Status(const std::string&)>& write_files,
    const std::function<absl::Status(const std::string& stage)>& fault_point = nullptr);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_CHECKPOINT_DIR_H_
