#include "lib/kernels/add_blocks.h"

#include <cuda_runtime.h>

namespace lorastep {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSlices = 64;  // thread blocks per table block at most (grid y)

// Grid x: one table block each; grid y: slices of its elements, grid-strided.
__global__ void AddBlocksKernel(const int64_t* table) {
  const int64_t* e = table + kAddBlockFields * static_cast<int64_t>(blockIdx.x);
  float* dst = reinterpret_cast<float*>(e[0]);
  const float* src = reinterpret_cast<const float*>(e[1]);
  const int64_t rows = e[2], cols = e[3], stride = e[4], n = rows * cols;
  const int64_t step = static_cast<int64_t>(gridDim.y) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x; i < n; i += step) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[i] += src[r * stride + c];
  }
}

}  // namespace

const char* LaunchAddBlocks(const int64_t* table, int64_t count, int64_t largest, void* stream) {
  if (count == 0 || largest == 0) return nullptr;
  if (count > 0x7fffffff) return "AddBlocks: too many blocks for one launch";
  int64_t slices = (largest + kThreads * 4 - 1) / (kThreads * 4);  // about 4 elements a thread
  slices = slices < 1 ? 1 : (slices > kMaxSlices ? kMaxSlices : slices);
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(slices));
  AddBlocksKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace kernels
}  // namespace lorastep
