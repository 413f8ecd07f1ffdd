// Conversions between safetensors entries and at::Tensor.
#ifndef LORASTEP_LIB_IO_TENSOR_BYTES_H_
#define LORASTEP_LIB_IO_TENSOR_BYTES_H_

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/io/safetensors.h"

namespace lorastep {

absl::StatusOr<at::ScalarType> ScalarTypeOf(DType dtype);
absl::StatusOr<DType> DTypeOf(at::ScalarType type);
// "float32" / "bfloat16" / "float16" (Hugging Face's torch_dtype spelling).
absl::StatusOr<at::ScalarType> ScalarTypeFromName(const std::string& name);

// Copies an entry into a new CPU tensor of the entry's dtype.
absl::StatusOr<at::Tensor> TensorFromEntry(const SafetensorsEntry& entry);

// Tensors kept alive (contiguous, on CPU) while their bytes are written.
class TensorWriteList {
 public:
  absl::Status Add(const std::string& name, const at::Tensor& tensor);
  absl::Status WriteTo(const std::string& path,
                       const std::map<std::string, std::string>& metadata = {}) const;

 private:
  std::vector<at::Tensor> keep_alive_;
  std::vector<TensorToWrite> entries_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_TENSOR_BYTES_H_
