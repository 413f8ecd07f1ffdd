#include "lib/kernels/sum_squares.h"

#include <cuda_runtime.h>

namespace lorastep {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// One block per chunk: each thread sums the squares of a strided slice in fp64, then a fixed
// tree over the block (the same order on every launch).
__global__ void ChunkSquaresKernel(const int64_t* table, double* partials) {
  const int64_t chunk = blockIdx.x;
  const float* data = reinterpret_cast<const float*>(table[3 * chunk]);
  const int64_t n = table[3 * chunk + 1];
  const bool negative = table[3 * chunk + 2] != 0;
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const double x = data[i];
    sum += x * x;
  }
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    partials[chunk] = negative ? -total : total;
  }
}

// One thread per group adds its chunks' partials in table order.
__global__ void GroupTotalsKernel(const double* partials, const int64_t* group_ends, int64_t groups, double* out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  double total = 0;
  for (int64_t c = g == 0 ? 0 : group_ends[g - 1]; c < group_ends[g]; ++c) total += partials[c];
  out[g] = total;
}

}  // namespace

const char* LaunchGroupSumsOfSquares(const int64_t* table, int64_t chunks, const int64_t* group_ends, int64_t groups,
                                     double* partials, double* out, void* stream) {
  if (groups == 0) return nullptr;
  if (chunks > 0x7fffffff) return "GroupSumsOfSquares: too many chunks for one launch";
  const auto s = static_cast<cudaStream_t>(stream);
  if (chunks > 0) ChunkSquaresKernel<<<static_cast<unsigned>(chunks), kThreads, 0, s>>>(table, partials);
  const auto blocks = static_cast<unsigned>((groups + kThreads - 1) / kThreads);
  GroupTotalsKernel<<<blocks, kThreads, 0, s>>>(partials, group_ends, groups, out);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace kernels
}  // namespace lorastep
