// Device helpers shared by lorastep's kernels: conversions that round exactly as ATen's
// elementwise kernels do (compute in fp32, round once to the storage type), a block-wide
// sum, and the dispatch from ElementType to a storage type.
#ifndef LORASTEP_LIB_KERNELS_CUDA_MATH_CUH_
#define LORASTEP_LIB_KERNELS_CUDA_MATH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T FromFloat(float x);
template <> __device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half(x); }
// x rounded to T and back: the value an ATen op that stores T hands to the next op.
template <typename T> __device__ __forceinline__ float Round(float x) { return ToFloat(FromFloat<T>(x)); }

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), returned to every
// thread. `scratch` holds 32 floats in shared memory.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (warps == 1) return v;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}

// V consecutive elements moved as one 16-byte (V = 16 / sizeof(T)) or narrower access: the
// elementwise kernels are memory-bound, and element-sized accesses leave most of the
// memory bandwidth unused.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> Load(const T* p, int64_t i) {
  return reinterpret_cast<const Pack<T, V>*>(p)[i];
}

template <typename T, int V>
__device__ __forceinline__ void Store(T* p, int64_t i, const Pack<T, V>& x) {
  reinterpret_cast<Pack<T, V>*>(p)[i] = x;
}

// Whether every size (element counts, row strides) and pointer allows 16-byte packs of T.
template <typename T>
bool Packable(std::initializer_list<int64_t> sizes, std::initializer_list<const void*> pointers) {
  constexpr int kBytes = 16, kPerPack = kBytes / static_cast<int>(sizeof(T));
  for (int64_t n : sizes) {
    if (n % kPerPack != 0) return false;
  }
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % kBytes != 0) return false;
  }
  return true;
}

// Calls f(T{}) with T the storage type of `type`.
template <typename F>
void DispatchElementType(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kFloat32: f(float{}); break;
    case ElementType::kBFloat16: f(__nv_bfloat16{}); break;
    case ElementType::kFloat16: f(__half{}); break;
  }
}

inline const char* LastLaunchError() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_CUDA_MATH_CUH_
