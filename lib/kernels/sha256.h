// SHA-256 of many byte ranges of device memory at once (CUDA build only): the adapter
// digest's chunks (lib/io/digest.h) hashed where the adapter lives, so a LoRA step's digest
// copies 32 bytes per chunk to the host instead of the whole adapter.
#ifndef LORASTEP_LIB_KERNELS_SHA256_H_
#define LORASTEP_LIB_KERNELS_SHA256_H_

#include <cstdint>

namespace lorastep {
namespace kernels {

// For each range i < count: digests[32 i .. 32 i + 32) = SHA-256 of the sizes[i] bytes at
// device address starts[i], standard FIPS 180-4 (so the host's OpenSSL gives the same bytes).
// The ranges may lie in any number of buffers: one launch hashes them all, so several runs'
// adapters fill the GPU together. starts, sizes and digests are device pointers; runs on
// `stream` (a cudaStream_t). Returns a CUDA error string, or nullptr.
const char* LaunchRangeSha256(const int64_t* starts, const int64_t* sizes, int64_t count, uint8_t* digests,
                              void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_SHA256_H_
