#include "lib/kernels/adamw_flat.h"

#include <cuda_runtime.h>

namespace lorastep {
namespace kernels {
namespace {

// Non-negative floats (NaN made positive by fabsf) order like their bits as unsigned ints,
// and a NaN's bits exceed infinity's: atomicMax on the bits keeps the largest, NaN first.
__device__ __forceinline__ unsigned MagnitudeBits(float x) { return __float_as_uint(fabsf(x)); }

__global__ void AdamWFlatKernel(FlatParts grad, float* m, float* v, float* master, int64_t n, AdamWScalars s,
                                bool write, unsigned* largest) {
  unsigned top = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    int part = 0;
    while (part + 1 < grad.count && i >= grad.ends[part]) ++part;
    const float g = grad.data[part][i - (part == 0 ? 0 : grad.ends[part - 1])];
    const float m1 = m[i] * s.beta1 + g * s.grad_weight;
    const float v1 = v[i] * s.beta2 + g * g * s.square_weight;
    const float denom = sqrtf(v1) / s.sqrt_bc2 + s.eps;
    const float w1 = master[i] * s.decay + s.step * (m1 / denom);
    if (write) {
      m[i] = m1, v[i] = v1, master[i] = w1;
    } else {
      top = max(top, MagnitudeBits(w1));
    }
  }
  if (write) return;
  for (int offset = 16; offset > 0; offset >>= 1) top = max(top, __shfl_xor_sync(0xffffffffu, top, offset));
  if ((threadIdx.x & 31) == 0) atomicMax(largest, top);
}

}  // namespace

const char* LaunchAdamWFlat(const FlatParts& grad, float* m, float* v, float* master, int64_t n,
                            const AdamWScalars& s, bool write, float* largest, void* stream) {
  if (n == 0) return nullptr;
  if (grad.count < 1 || grad.count > FlatParts::kMaxParts || grad.ends[grad.count - 1] != n) {
    return "AdamWFlat: the gradient's parts do not cover the flat state";
  }
  if (!write && largest == nullptr) return "AdamWFlat: a check needs somewhere to put the largest value";
  constexpr int kThreads = 256;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int64_t blocks = wanted < int64_t{8} * sms ? wanted : int64_t{8} * sms;  // grid-stride past a few waves
  AdamWFlatKernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      grad, m, v, master, n, s, write, reinterpret_cast<unsigned*>(largest));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace kernels
}  // namespace lorastep
