// Small POSIX file helpers with Status errors: durable writes (fsync) and whole-file reads.
#ifndef LORASTEP_LIB_IO_FILE_UTIL_H_
#define LORASTEP_LIB_IO_FILE_UTIL_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lorastep {

// Writes a file sequentially; Close() fsyncs it. A writer destroyed without Close() leaves
// a partial file behind (callers write into temporary folders for atomicity).
class FileWriter {
 public:
  static absl::StatusOr<FileWriter> Create(const std::string& path);
  FileWriter(FileWriter&& other) noexcept;
  FileWriter& operator=(FileWriter&&) = delete;
  ~FileWriter();

  absl::Status Append(const void* data, size_t size);
  absl::Status Close();

 private:
  FileWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// The Status for the current errno after `what` failed on `path`, naming both: a full disk
// or quota is RESOURCE_EXHAUSTED, a missing path NOT_FOUND, no permission PERMISSION_DENIED.
absl::Status ErrnoError(absl::string_view what, const std::string& path);

absl::Status WriteStringToFile(const std::string& path, const std::string& contents);
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// fsyncs a directory so that renames and new entries in it are durable.
absl::Status SyncDirectory(const std::string& path);
bool PathExists(const std::string& path);
// Removes a file or a folder tree; absent paths are fine.
absl::Status RemoveAll(const std::string& path);
absl::Status MakeDirectories(const std::string& path);
// "a/b/c" -> "a/b"; "c" -> "."; trailing slashes ignored.
std::string ParentPath(const std::string& path);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_FILE_UTIL_H_
