// SHA-256 digests of tensors: replica hashes and published-adapter hashes.
#ifndef LORASTEP_LIB_IO_DIGEST_H_
#define LORASTEP_LIB_IO_DIGEST_H_

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace lorastep {

// Hex SHA-256 over each tensor's dtype, shape and bytes (CPU, contiguous), in order. A
// tensor over 8 MiB contributes the SHA-256s of its 8 MiB chunks instead of its bytes
// (hashed on up to 16 threads): a large adapter's per-step digest stays cheap.
std::string TensorsSha256(const std::vector<at::Tensor>& tensors);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_DIGEST_H_
