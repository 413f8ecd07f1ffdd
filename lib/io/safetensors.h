// Reader and writer for the safetensors format (the layout Hugging Face and PEFT use):
// an 8-byte little-endian header length N, N bytes of JSON mapping tensor names to
// {dtype, shape, data_offsets}, then raw little-endian tensor data.
//
// Torch-free on purpose: it is the parsing boundary for untrusted files and is tested in
// isolation; lib/io/tensor_bytes.h turns entries into at::Tensor.
//
// Example:
//   ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open("model.safetensors"));
//   ASSIGN_OR_RETURN(const SafetensorsEntry* e, f.Find("lm_head.weight"));
//
// Thread-safety: an opened file is immutable and may be read from any thread.
#ifndef LORASTEP_LIB_IO_SAFETENSORS_H_
#define LORASTEP_LIB_IO_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lorastep {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32", "BF16", ... as safetensors spells them.
absl::string_view DTypeName(DType dtype);
absl::StatusOr<DType> ParseDType(absl::string_view name);
size_t DTypeSize(DType dtype);

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the owning SafetensorsFile's mapping
  size_t nbytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps the file read-only and validates the whole header: every error names the file
  // and, where it applies, the tensor.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // NOT_FOUND naming the tensor and the file when absent.
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;  // numel * DTypeSize(dtype) bytes, little-endian
};

// Writes `tensors` (in the given order) to `path` and fsyncs it. Names must be unique.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_SAFETENSORS_H_
