// The sampler's decode attention over its block-paged key/value cache (CUDA build only):
// each decoding sequence's one query per head attends over all of its cached positions,
// read in place from the pool's blocks (no gathered copy, no fp32 copy of the keys and
// values), with an online softmax in fp32. Long sequences at small batches are split over
// several thread blocks along their positions and the parts combined.
#ifndef LORASTEP_LIB_KERNELS_PAGED_DECODE_H_
#define LORASTEP_LIB_KERNELS_PAGED_DECODE_H_

#include <cstdint>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

// Whether the kernel takes this head shape: head_dim 64, 128 or 256 and at most 8 query
// heads per key/value head. Other shapes use the ATen composition.
bool PagedDecodeSupported(int64_t group, int64_t head_dim);

// How many parts each sequence's positions are split into, and the fp32 workspace (in
// floats) the parts need (0 when there is one part).
struct PagedDecodePlan {
  int64_t splits = 1;
  int64_t split_length = 0;
  int64_t workspace_floats = 0;
};
PagedDecodePlan PlanPagedDecode(int64_t sequences, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t max_length);

// q: [sequences, kv_heads * group, head_dim] (query head j*group + i uses key/value head j),
// contiguous, of `type`; keys, values: the pool's [slots, kv_heads, head_dim] of `type`;
// table: int32 [sequences, table_stride], sequence s's block ids in position order (slot of
// position p: table[s][p / block_size] * block_size + p % block_size); lengths: int32
// [sequences], the positions each attends over (at most plan.splits * plan.split_length).
// `window` > 0 (a sliding-window layer): only the last `window` positions. Writes out
// [sequences, kv_heads * group, head_dim] of `type`:
//   softmax(scale * q . k_p over length - window <= p < length) . v_p
// Runs on `stream` (a cudaStream_t). Returns a CUDA error string, or nullptr.
const char* LaunchPagedDecode(const void* q, const void* keys, const void* values, ElementType type,
                              const int32_t* table, int64_t table_stride, const int32_t* lengths,
                              int64_t sequences, int64_t kv_heads, int64_t group, int64_t head_dim,
                              int64_t block_size, int64_t window, float scale, const PagedDecodePlan& plan,
                              float* workspace,
                              void* out, void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_PAGED_DECODE_H_
