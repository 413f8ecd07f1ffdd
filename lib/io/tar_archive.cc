#include "lib/io/tar_archive.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

constexpr size_t kBlock = 512;
constexpr uint64_t kMaxFileBytes = (uint64_t{1} << 33) - 1;  // 11 octal digits

// `value` as `width - 1` octal digits and a NUL.
void Octal(char* field, size_t width, uint64_t value) {
  std::snprintf(field, width, "%0*llo", static_cast<int>(width - 1), static_cast<unsigned long long>(value));
}

// A ustar header for `name` (relative to the archive's root).
absl::StatusOr<std::string> Header(const std::string& name, bool folder, uint64_t size) {
  std::string block(kBlock, '\0');
  char* h = block.data();
  // A name past 100 bytes splits at a '/' into a prefix (<= 155 bytes) and a name (1-100).
  std::string head, tail = name;
  if (name.size() > 100) {
    size_t cut = std::string::npos;
    for (size_t i = name.find('/'); i != std::string::npos && i <= 155; i = name.find('/', i + 1)) {
      const size_t rest = name.size() - i - 1;
      if (rest > 0 && rest <= 100) {
        cut = i;
        break;
      }
    }
    if (cut == std::string::npos) {
      return absl::FailedPreconditionError(absl::StrCat("archive: the path '", name, "' is too long for a tar header"));
    }
    head = name.substr(0, cut);
    tail = name.substr(cut + 1);
  }
  std::memcpy(h, tail.data(), tail.size());
  Octal(h + 100, 8, folder ? 0755 : 0644);
  Octal(h + 108, 8, 0);
  Octal(h + 116, 8, 0);
  Octal(h + 124, 12, folder ? 0 : size);
  Octal(h + 136, 12, 0);
  std::memset(h + 148, ' ', 8);  // the checksum counts its own field as spaces
  h[156] = folder ? '5' : '0';
  std::memcpy(h + 257, "ustar", 6);
  std::memcpy(h + 263, "00", 2);
  std::memcpy(h + 345, head.data(), head.size());
  unsigned sum = 0;
  for (unsigned char c : block) sum += c;
  std::snprintf(h + 148, 8, "%06o", sum);  // six digits, NUL, then the space already there
  return block;
}

absl::Status AddFile(const std::string& path, const std::string& name, uint64_t size,
                     const std::function<absl::Status(absl::string_view)>& sink) {
  if (size > kMaxFileBytes) {
    return absl::FailedPreconditionError(absl::StrCat("archive: '", name, "' is ", size, " bytes; a tar entry holds less than 8 GiB"));
  }
  LORASTEP_ASSIGN_OR_RETURN(std::string header, Header(name, false, size));
  LORASTEP_RETURN_IF_ERROR(sink(header));
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open", path);
  std::vector<char> buffer(1 << 20);
  uint64_t left = size;
  absl::Status status;
  while (left > 0 && status.ok()) {
    const ssize_t n = read(fd, buffer.data(), std::min<uint64_t>(buffer.size(), left));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = n < 0 ? ErrnoError("read", path)
                     : absl::FailedPreconditionError(absl::StrCat("archive: '", name, "' shrank while it was read"));
      break;
    }
    status = sink(absl::string_view(buffer.data(), static_cast<size_t>(n)));
    left -= static_cast<uint64_t>(n);
  }
  close(fd);
  LORASTEP_RETURN_IF_ERROR(status);
  const size_t pad = (kBlock - size % kBlock) % kBlock;
  return pad == 0 ? absl::OkStatus() : sink(std::string(pad, '\0'));
}

absl::Status AddFolder(const std::string& path, const std::string& name,
                       const std::function<absl::Status(absl::string_view)>& sink) {
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return ErrnoError("opendir", path);
  std::vector<std::string> entries;
  while (const dirent* e = readdir(dir)) {
    const std::string n = e->d_name;
    if (n.empty() || n[0] != '.') entries.push_back(n);  // hidden: the store's marker, "." and ".."
  }
  closedir(dir);
  std::sort(entries.begin(), entries.end());
  for (const std::string& entry : entries) {
    const std::string child = path + "/" + entry, child_name = name + entry;
    struct stat st;
    if (lstat(child.c_str(), &st) != 0) return ErrnoError("lstat", child);
    if (S_ISREG(st.st_mode)) {
      LORASTEP_RETURN_IF_ERROR(AddFile(child, child_name, static_cast<uint64_t>(st.st_size), sink));
    } else if (S_ISDIR(st.st_mode)) {
      LORASTEP_ASSIGN_OR_RETURN(std::string header, Header(child_name + "/", true, 0));
      LORASTEP_RETURN_IF_ERROR(sink(header));
      LORASTEP_RETURN_IF_ERROR(AddFolder(child, child_name + "/", sink));
    } else {
      return absl::FailedPreconditionError(absl::StrCat(
          "archive: '", child_name, "' is ", S_ISLNK(st.st_mode) ? "a symbolic link" : "not a file or folder",
          "; only regular files and folders are archived"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteTarArchive(const std::string& folder, const std::string& prefix,
                             const std::function<absl::Status(absl::string_view)>& sink,
                             const std::map<std::string, std::string>& extra) {
  struct stat st;
  if (lstat(folder.c_str(), &st) != 0) return ErrnoError("lstat", folder);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("archive: '", folder, "' is not a folder"));
  }
  std::string root = prefix;
  if (!root.empty() && root.back() != '/') root += '/';
  if (!root.empty()) {
    LORASTEP_ASSIGN_OR_RETURN(std::string header, Header(root, true, 0));
    LORASTEP_RETURN_IF_ERROR(sink(header));
  }
  LORASTEP_RETURN_IF_ERROR(AddFolder(folder, root, sink));
  for (const auto& [name, contents] : extra) {
    LORASTEP_ASSIGN_OR_RETURN(std::string header, Header(root + name, false, contents.size()));
    LORASTEP_RETURN_IF_ERROR(sink(header));
    LORASTEP_RETURN_IF_ERROR(sink(contents));
    const size_t pad = (kBlock - contents.size() % kBlock) % kBlock;
    if (pad > 0) LORASTEP_RETURN_IF_ERROR(sink(std::string(pad, '\0')));
  }
  return sink(std::string(2 * kBlock, '\0'));  // the end: two zero blocks
}

}  // namespace lorastep
