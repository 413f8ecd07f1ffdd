#include "lib/kernels/fused_layer.h"

#include <cmath>

#include "lib/kernels/cuda_math.cuh"

namespace lorastep {
namespace kernels {
namespace {

// One block per row; wide rows get more threads (head-dim norms of Qwen3 get one warp).
int RowThreads(int64_t hidden) { return hidden <= 256 ? 32 : hidden <= 2048 ? 128 : 256; }

unsigned ElementwiseBlocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

template <typename T>
__global__ void RmsNormKernel(const T* __restrict__ x, const T* __restrict__ weight, int64_t hidden,
                              float eps, T* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = ToFloat(xr[i]);
    sum += v * v;
  }
  sum = BlockSum(sum, scratch);
  const float r = rsqrtf(sum / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  T* yr = y + row * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    yr[i] = FromFloat<T>(ToFloat(weight[i]) * Round<T>(ToFloat(xr[i]) * r));
  }
}

template <typename T>
__global__ void RmsNormGradKernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ weight,
                                  const float* __restrict__ rstd, int64_t hidden, T* __restrict__ dx) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* gr = g + row * hidden;
  const T* xr = x + row * hidden;
  const float r = rstd[row];
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    dot += Round<T>(ToFloat(gr[i]) * ToFloat(weight[i])) * (ToFloat(xr[i]) * r);
  }
  dot = BlockSum(dot, scratch) / static_cast<float>(hidden);
  T* out = dx + row * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float gn = Round<T>(ToFloat(gr[i]) * ToFloat(weight[i]));
    const float n = ToFloat(xr[i]) * r;
    out[i] = FromFloat<T>((gn - n * dot) * r);
  }
}

__device__ __forceinline__ float Sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

template <typename T>
__global__ void SwiGluKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t n, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float a = ToFloat(gate[i]);
    out[i] = FromFloat<T>(Round<T>(a / (1.f + expf(-a))) * ToFloat(up[i]));
  }
}

template <typename T>
__global__ void SwiGluGradKernel(const T* __restrict__ g, const T* __restrict__ gate, const T* __restrict__ up,
                                 int64_t n, T* __restrict__ grad_gate, T* __restrict__ grad_up) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float a = ToFloat(gate[i]), gi = ToFloat(g[i]);
    const float s = Sigmoid(a);
    const float dy = Round<T>(gi * ToFloat(up[i]));
    grad_gate[i] = FromFloat<T>(dy * s * (1.f + a * (1.f - s)));
    grad_up[i] = FromFloat<T>(gi * Round<T>(a / (1.f + expf(-a))));
  }
}

template <typename T>
__global__ void RopeKernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                           const int64_t* __restrict__ positions, int64_t total, int64_t seq_len, int64_t heads,
                           int64_t dim, bool backward, T* __restrict__ y) {
  const int64_t half = dim / 2;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % dim, token = i / dim / heads;
    const int64_t pos = positions != nullptr ? positions[token] : token % seq_len;
    const T* c = cos + pos * dim;
    const T* s = sin + pos * dim;
    const float straight = Round<T>(ToFloat(x[i]) * ToFloat(c[j]));
    float turned;
    if (!backward) {  // rotate_half(x)[j] * sin[j]
      turned = j < half ? Round<T>(-ToFloat(x[i + half]) * ToFloat(s[j])) : Round<T>(ToFloat(x[i - half]) * ToFloat(s[j]));
    } else {  // rotate_half^T(x * sin)[j]
      turned = j < half ? Round<T>(ToFloat(x[i + half]) * ToFloat(s[j + half]))
                        : -Round<T>(ToFloat(x[i - half]) * ToFloat(s[j - half]));
    }
    y[i] = FromFloat<T>(straight + turned);
  }
}

constexpr int kElementwiseThreads = 256;

}  // namespace

const char* LaunchRmsNorm(const void* x, const void* weight, ElementType type, int64_t rows, int64_t hidden,
                          float eps, void* y, float* rstd, void* stream) {
  if (rows == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    RmsNormKernel<T><<<static_cast<unsigned>(rows), RowThreads(hidden), 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), hidden, eps, static_cast<T*>(y), rstd);
  });
  return LastLaunchError();
}

const char* LaunchRmsNormGrad(const void* grad_y, const void* x, const void* weight, const float* rstd,
                              ElementType type, int64_t rows, int64_t hidden, void* grad_x, void* stream) {
  if (rows == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    RmsNormGradKernel<T><<<static_cast<unsigned>(rows), RowThreads(hidden), 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(grad_y), static_cast<const T*>(x), static_cast<const T*>(weight), rstd, hidden,
        static_cast<T*>(grad_x));
  });
  return LastLaunchError();
}

const char* LaunchSwiGlu(const void* gate, const void* up, ElementType type, int64_t n, void* out, void* stream) {
  if (n == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    SwiGluKernel<T><<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(gate), static_cast<const T*>(up), n,
                                                           static_cast<T*>(out));
  });
  return LastLaunchError();
}

const char* LaunchSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type, int64_t n,
                             void* grad_gate, void* grad_up, void* stream) {
  if (n == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    SwiGluGradKernel<T><<<ElementwiseBlocks(n, kElementwiseThreads), kElementwiseThreads, 0,
                          static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(grad_out), static_cast<const T*>(gate), static_cast<const T*>(up), n,
        static_cast<T*>(grad_gate), static_cast<T*>(grad_up));
  });
  return LastLaunchError();
}

const char* LaunchRope(const void* x, const void* cos, const void* sin, const int64_t* positions, ElementType type,
                       int64_t tokens, int64_t seq_len, int64_t heads, int64_t dim, bool backward, void* y,
                       void* stream) {
  const int64_t total = tokens * heads * dim;
  if (total == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    RopeKernel<T><<<ElementwiseBlocks(total, kElementwiseThreads), kElementwiseThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(static_cast<const T*>(x), static_cast<const T*>(cos),
                                                         static_cast<const T*>(sin), positions, total, seq_len, heads,
                                                         dim, backward, static_cast<T*>(y));
  });
  return LastLaunchError();
}

}  // namespace kernels
}  // namespace lorastep
