#include "lib/io/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ftw.h>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

// The status code says what the caller can do: a full disk or quota is RESOURCE_EXHAUSTED
// (free space, retry), a missing path NOT_FOUND, no permission PERMISSION_DENIED.
absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int err = errno;
  const std::string msg = absl::StrCat(path, ": ", what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC: case EDQUOT: return absl::ResourceExhaustedError(msg);
    case ENOENT: case ENOTDIR: return absl::NotFoundError(msg);
    case EACCES: case EPERM: case EROFS: return absl::PermissionDeniedError(msg);
    default: return absl::InternalError(msg);
  }
}

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

// POSIX rather than std::filesystem on purpose: torch 2.11's libtorch.so exports its own
// std::filesystem symbols, and calls bound to them crash in the CUDA build.
absl::Status RemoveAll(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // already absent
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) -> int {
    return remove(p);
  };
  if (nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return ErrnoError("cannot remove", path);
  }
  return absl::OkStatus();
}

absl::Status MakeDirectories(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError("cannot create folder", prefix);
    }
  }
  return absl::OkStatus();
}

std::string ParentPath(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

}  // namespace lorastep
