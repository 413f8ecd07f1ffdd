#include "lib/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(path, ": ", what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<FileWriter> FileWriter::Create(const std::string& path) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", path);
  return FileWriter(path, fd);
}

FileWriter::FileWriter(FileWriter&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

FileWriter::~FileWriter() {
  if (fd_ >= 0) close(fd_);
}

absl::Status FileWriter::Append(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write failed", path_);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FileWriter::Close() {
  if (fsync(fd_) != 0) return ErrnoError("fsync failed", path_);
  int fd = std::exchange(fd_, -1);
  if (close(fd) != 0) return ErrnoError("close failed", path_);
  return absl::OkStatus();
}

absl::Status WriteStringToFile(const std::string& path, const std::string& contents) {
  LORASTEP_ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Create(path));
  LORASTEP_RETURN_IF_ERROR(writer.Append(contents.data(), contents.size()));
  return writer.Close();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status SyncDirectory(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open folder", path);
  int rc = fsync(fd);
  close(fd);
  if (rc != 0) return ErrnoError("fsync failed", path);
  return absl::OkStatus();
}

bool PathExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

absl::Status RemoveAll(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": cannot remove: ", ec.message()));
  return absl::OkStatus();
}

absl::Status MakeDirectories(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": cannot create folder: ", ec.message()));
  return absl::OkStatus();
}

}  // namespace lorastep
