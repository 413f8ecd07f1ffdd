// Many small fp32 accumulations in one launch (CUDA build only): a joint row's per-run LoRA
// factor gradients added into each run's own main_grad, where one ATen add (or a view per
// operand for a fused foreach add) per run and part costs more host time than the adds take.
#ifndef LORASTEP_LIB_KERNELS_ADD_BLOCKS_H_
#define LORASTEP_LIB_KERNELS_ADD_BLOCKS_H_

#include <cstdint>

namespace lorastep {
namespace kernels {

// The int64 fields of one block in the table LaunchAddBlocks reads.
constexpr int kAddBlockFields = 5;  // dst address, src address, rows, cols, src row stride

// For each block b < count (table: device, kAddBlockFields int64 per block):
// dst[r * cols + c] += src[r * src_row_stride + c] for r < rows, c < cols, fp32, dst
// contiguous. The blocks' destinations must not overlap; each element is added once, so the
// result is the same bits as one elementwise add per block. `largest`: the most elements in
// one block (sizes the launch). Runs on `stream` (a cudaStream_t). Returns a CUDA error
// string, or nullptr.
const char* LaunchAddBlocks(const int64_t* table, int64_t count, int64_t largest, void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_ADD_BLOCKS_H_
