// Sums of squares of many fp32 device ranges in fp64, several groups in one launch (CUDA build
// only): every co-scheduled run's gradient norm at once, where ATen makes an fp64 copy, its
// square and a sum per buffer.
#ifndef LORASTEP_LIB_KERNELS_SUM_SQUARES_H_
#define LORASTEP_LIB_KERNELS_SUM_SQUARES_H_

#include <cstdint>

namespace lorastep {
namespace kernels {

// The element count each chunk of a range covers (the last chunk of a range may be shorter).
constexpr int64_t kSquareChunkElements = int64_t{1} << 16;

// `table` (device, 3 int64 per chunk): the fp32 address of the chunk's first element, its
// element count (<= kSquareChunkElements), and 1 where it counts negatively, else 0. Chunks of
// a group are consecutive; `group_ends` (device, `groups` int64) holds each group's end in chunks.
// out[g] (device, fp64) = the sum over g's chunks of +-(sum of the squares of its elements),
// each chunk reduced in a fixed order and the chunks added in table order: the same ranges give
// the same bits whatever other groups share the launch. `partials`: device scratch, one double
// per chunk. Runs on `stream` (a cudaStream_t). Returns a CUDA error string, or nullptr.
const char* LaunchGroupSumsOfSquares(const int64_t* table, int64_t chunks, const int64_t* group_ends, int64_t groups,
                                     double* partials, double* out, void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_SUM_SQUARES_H_
