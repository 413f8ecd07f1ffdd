#include "lib/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"
#include "nlohmann/json.hpp"

namespace lorastep {
namespace {

// A header larger than this is not a model file (HF caps it at 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2}, {DType::kI8, "I8", 1},   {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is listed
}

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }
size_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const auto& info : kDTypes) {
    if (name == info.name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_size_ = std::exchange(other.mapping_size_, 0);
    entries_ = std::move(other.entries_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsFile::Find(absl::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated: ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  file.mapping_ = map;
  file.mapping_size_ = size;
  const auto* bytes = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": corrupt header: header length ",
                                                   header_len, " exceeds the file (", size,
                                                   " bytes)"));
  }
  nlohmann::json header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len, nullptr,
                                                /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": corrupt header: not a JSON object"));
  }
  const uint8_t* data_start = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__['", m.key(), "'] is not a string"));
        }
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "': ", why));
    };
    const nlohmann::json& spec = *it;
    if (!spec.is_object() || !spec.contains("dtype") || !spec.contains("shape") ||
        !spec.contains("data_offsets")) {
      return bad("needs dtype, shape and data_offsets");
    }
    if (!spec["dtype"].is_string()) return bad("dtype is not a string");
    auto dtype = ParseDType(spec["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(dtype.status().message());
    SafetensorsEntry entry;
    entry.name = name;
    entry.dtype = *dtype;
    if (!spec["shape"].is_array()) return bad("shape is not an array");
    for (const auto& d : spec["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape holds a non-negative-integer value");
      entry.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = spec["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return bad("data_offsets must be two non-negative integers");
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, ") outside the ", data_size,
                              "-byte data section (truncated file?)"));
    }
    const uint64_t expected = static_cast<uint64_t>(entry.numel()) * DTypeSize(entry.dtype);
    if (end - begin != expected) {
      return bad(absl::StrCat("shape mismatch: shape and dtype need ", expected,
                              " bytes, data_offsets give ", end - begin));
    }
    entry.data = data_start + begin;
    entry.nbytes = end - begin;
    ranges.emplace_back(begin, end);
    file.entries_.push_back(std::move(entry));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": corrupt header: overlapping tensor data"));
    }
  }
  return file;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": duplicate tensor '", t.name, "'"));
    }
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "': negative dimension"));
      }
      numel *= d;
    }
    const uint64_t nbytes = static_cast<uint64_t>(numel) * DTypeSize(t.dtype);
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text = header.dump();
  // Pad with spaces so tensor data starts 8-byte aligned, as the reference writer does.
  while ((header_text.size() % 8) != 0) header_text.push_back(' ');
  std::string prefix(8, '\0');
  uint64_t len = header_text.size();
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((len >> (8 * i)) & 0xff);

  LORASTEP_ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Create(path));
  LORASTEP_RETURN_IF_ERROR(writer.Append(prefix.data(), prefix.size()));
  LORASTEP_RETURN_IF_ERROR(writer.Append(header_text.data(), header_text.size()));
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    LORASTEP_RETURN_IF_ERROR(
        writer.Append(t.data, static_cast<size_t>(numel) * DTypeSize(t.dtype)));
  }
  return writer.Close();
}

}  // namespace lorastep
