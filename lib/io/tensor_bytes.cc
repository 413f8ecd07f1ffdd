#include "lib/io/tensor_bytes.h"

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

absl::StatusOr<at::ScalarType> ScalarTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kF64: return at::kDouble;
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kI64: return at::kLong;
    case DType::kI32: return at::kInt;
    case DType::kI16: return at::kShort;
    case DType::kI8: return at::kChar;
    case DType::kU8: return at::kByte;
    case DType::kBool: return at::kBool;
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::StatusOr<DType> DTypeOf(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return DType::kF64;
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kLong: return DType::kI64;
    case at::kInt: return DType::kI32;
    case at::kShort: return DType::kI16;
    case at::kChar: return DType::kI8;
    case at::kByte: return DType::kU8;
    case at::kBool: return DType::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no safetensors dtype for ", c10::toString(type)));
  }
}

absl::StatusOr<at::ScalarType> ScalarTypeFromName(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return absl::InvalidArgumentError(absl::StrCat("dtype: unsupported '", name, "'"));
}

absl::StatusOr<at::Tensor> TensorFromEntry(const SafetensorsEntry& entry) {
  LORASTEP_ASSIGN_OR_RETURN(at::ScalarType type, ScalarTypeOf(entry.dtype));
  at::Tensor out = at::empty(entry.shape, at::TensorOptions().dtype(type));
  if (entry.nbytes > 0) std::memcpy(out.data_ptr(), entry.data, entry.nbytes);
  return out;
}

absl::Status TensorWriteList::Add(const std::string& name, const at::Tensor& tensor) {
  LORASTEP_ASSIGN_OR_RETURN(DType dtype, DTypeOf(tensor.scalar_type()));
  at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
  keep_alive_.push_back(cpu);
  entries_.push_back(TensorToWrite{name, dtype,
                                   std::vector<int64_t>(cpu.sizes().begin(), cpu.sizes().end()),
                                   cpu.data_ptr()});
  return absl::OkStatus();
}

absl::Status TensorWriteList::WriteTo(const std::string& path,
                                      const std::map<std::string, std::string>& metadata) const {
  return WriteSafetensors(path, entries_, metadata);
}

}  // namespace lorastep
