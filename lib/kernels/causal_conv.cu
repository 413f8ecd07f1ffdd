#include "lib/kernels/causal_conv.h"

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "lib/kernels/cuda_math.cuh"

namespace lorastep {
namespace kernels {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

__device__ __forceinline__ float Sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

// The pre-activation u of row t (its sequence starting at row `start`) for the V channels of
// pack p, rounded to T as the composition's convolution stores it.
template <typename T, int V>
__device__ __forceinline__ void PreActivation(const T* __restrict__ x, const T* __restrict__ weight, int64_t t,
                                              int64_t start, int64_t p, int64_t packs, int taps, float (&u)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) u[k] = 0.f;
  for (int j = 0; j < taps; ++j) {
    const int64_t row = t - (taps - 1) + j;
    if (row < start) continue;
    const Pack<T, V> xp = Load<T, V>(x + row * packs * V, p);
#pragma unroll
    for (int k = 0; k < V; ++k) u[k] += ToFloat(weight[(p * V + k) * taps + j]) * ToFloat(xp.v[k]);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) u[k] = Round<T>(u[k]);
}

// One thread per row and pack of V channels.
template <typename T, int V>
__global__ void CausalConvSiluKernel(const T* __restrict__ x, const T* __restrict__ weight, int64_t rows,
                                     int64_t length, int64_t packs, int taps, T* __restrict__ y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / packs, p = i % packs;
    float u[V];
    PreActivation<T, V>(x, weight, t, t - t % length, p, packs, taps, u);
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = FromFloat<T>(u[k] * Sigmoid(u[k]));
    Store<T, V>(y + t * packs * V, p, out);
  }
}

template <typename T, int V>
__global__ void CausalConvSiluGradKernel(const T* __restrict__ grad_y, const T* __restrict__ x,
                                         const T* __restrict__ weight, int64_t rows, int64_t length, int64_t packs,
                                         int taps, T* __restrict__ grad_x) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / packs, p = i % packs;
    const int64_t start = t - t % length, end = start + length;
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int j = 0; j < taps; ++j) {
      const int64_t later = t + (taps - 1) - j;  // the row whose tap j reads row t
      if (later >= end) continue;
      float u[V];
      PreActivation<T, V>(x, weight, later, start, p, packs, taps, u);
      const Pack<T, V> gp = Load<T, V>(grad_y + later * packs * V, p);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float s = Sigmoid(u[k]);
        const float gu = Round<T>(ToFloat(gp.v[k]) * (s * (1.f + u[k] * (1.f - s))));
        acc[k] += ToFloat(weight[(p * V + k) * taps + j]) * gu;
      }
    }
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = FromFloat<T>(acc[k]);
    Store<T, V>(grad_x + t * packs * V, p, out);
  }
}

const char* CheckShape(int64_t sequences, int64_t length, int64_t channels, int taps) {
  if (taps < 1 || taps > kMaxConvTaps) return "causal conv: taps out of [1, kMaxConvTaps]";
  if (sequences < 0 || length < 0 || channels < 0) return "causal conv: negative size";
  return nullptr;
}

// Calls launch(T{}, V) for `type`'s storage type T, with V = 16 / sizeof(T) channels a thread
// where the channel count and `pointers` allow 16-byte packs, else V = 1.
template <typename F>
const char* LaunchOverPacks(ElementType type, int64_t channels, std::initializer_list<const void*> pointers,
                            F&& launch) {
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    if (Packable<T>({channels}, pointers)) {
      launch(t, std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      launch(t, std::integral_constant<int, 1>{});
    }
  });
  return LastLaunchError();
}

}  // namespace

const char* LaunchCausalConvSilu(const void* x, const void* weight, ElementType type, int64_t sequences,
                                 int64_t length, int64_t channels, int taps, void* y, void* stream) {
  if (const char* bad = CheckShape(sequences, length, channels, taps)) return bad;
  const int64_t rows = sequences * length;
  if (rows * channels == 0) return nullptr;
  return LaunchOverPacks(type, channels, {x, y}, [&](auto t, auto v) {
    using T = decltype(t);
    constexpr int V = decltype(v)::value;
    CausalConvSiluKernel<T, V><<<Blocks(rows * channels / V), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), rows, length, channels / V, taps,
        static_cast<T*>(y));
  });
}

const char* LaunchCausalConvSiluGrad(const void* grad_y, const void* x, const void* weight, ElementType type,
                                     int64_t sequences, int64_t length, int64_t channels, int taps, void* grad_x,
                                     void* stream) {
  if (const char* bad = CheckShape(sequences, length, channels, taps)) return bad;
  const int64_t rows = sequences * length;
  if (rows * channels == 0) return nullptr;
  return LaunchOverPacks(type, channels, {grad_y, x, grad_x}, [&](auto t, auto v) {
    using T = decltype(t);
    constexpr int V = decltype(v)::value;
    CausalConvSiluGradKernel<T, V><<<Blocks(rows * channels / V), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(grad_y), static_cast<const T*>(x), static_cast<const T*>(weight), rows, length,
        channels / V, taps, static_cast<T*>(grad_x));
  });
}

}  // namespace kernels
}  // namespace lorastep
