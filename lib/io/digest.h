// SHA-256 digests of tensors: replica hashes and published-adapter hashes.
#ifndef LORASTEP_LIB_IO_DIGEST_H_
#define LORASTEP_LIB_IO_DIGEST_H_

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace lorastep {

// Hex SHA-256 over each tensor's dtype, shape and content, in order: the content enters as
// the SHA-256s of its bytes' 16 KiB chunks, hashed where the bytes are (on the GPU by
// lorastep's kernel in the CUDA build, else on up to 16 host threads after one copy per
// dtype), so a per-step adapter digest stays cheap. The same bytes give the same digest on
// every device.
std::string TensorsSha256(const std::vector<at::Tensor>& tensors);
// TensorsSha256 of each group, with the hashing of every group's bytes done together (on the
// GPU one kernel for every chunk of every group, read in place, and one wait; the groups' own
// digests on host threads side by side): several runs' adapter digests after a shared step.
std::vector<std::string> TensorGroupsSha256(const std::vector<std::vector<at::Tensor>>& groups);

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_DIGEST_H_
