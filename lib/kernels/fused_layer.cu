#include "lib/kernels/fused_layer.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>

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

// rows x f elements in packs of V (f, the strides and every pointer a multiple of the pack):
// gate/up rows `in_ld` apart (gate_up's halves: up = gate + f, in_ld = 2f), out contiguous.
template <typename T, int V>
__global__ void SwiGluKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t rows, int64_t f,
                             int64_t in_ld, T* __restrict__ out) {
  const int64_t packs_per_row = f / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * packs_per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs_per_row, c = i % packs_per_row;
    const int64_t in = (r * in_ld) / V + c;
    const Pack<T, V> g = Load<T, V>(gate, in), u = Load<T, V>(up, in);
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = ToFloat(g.v[k]);
      o.v[k] = FromFloat<T>(Round<T>(a / (1.f + expf(-a))) * ToFloat(u.v[k]));
    }
    Store<T, V>(out, i, o);
  }
}

// grad_gate/grad_up rows `out_ld` apart (the halves of gate_up's gradient: out_ld = 2f).
template <typename T, int V>
__global__ void SwiGluGradKernel(const T* __restrict__ g, const T* __restrict__ gate, const T* __restrict__ up,
                                 int64_t rows, int64_t f, int64_t in_ld, int64_t out_ld, T* __restrict__ grad_gate,
                                 T* __restrict__ grad_up) {
  const int64_t packs_per_row = f / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * packs_per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs_per_row, c = i % packs_per_row;
    const int64_t in = (r * in_ld) / V + c, out = (r * out_ld) / V + c;
    const Pack<T, V> gp = Load<T, V>(g, i), ap = Load<T, V>(gate, in), up_p = Load<T, V>(up, in);
    Pack<T, V> dg, du;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = ToFloat(ap.v[k]), gi = ToFloat(gp.v[k]);
      const float s = Sigmoid(a);
      const float dy = Round<T>(gi * ToFloat(up_p.v[k]));
      dg.v[k] = FromFloat<T>(dy * s * (1.f + a * (1.f - s)));
      du.v[k] = FromFloat<T>(gi * Round<T>(a / (1.f + expf(-a))));
    }
    Store<T, V>(grad_gate, out, dg);
    Store<T, V>(grad_up, out, du);
  }
}

// Strides of x in elements along batch, seq and heads (unit stride along dim).
struct RopeStrides {
  int64_t batch, seq, head;
};

// One thread per pair (j, j + dim/2) of a head's row: both outputs from the same four inputs.
// Index is 32-bit when the tensor allows (integer division dominated the 64-bit version).
template <typename T, typename Index>
__global__ void RopeKernel(const T* __restrict__ x, RopeStrides st, const T* __restrict__ cos,
                           const T* __restrict__ sin, const int64_t* __restrict__ positions, Index pairs,
                           Index seq_len, Index heads, Index dim, bool backward, T* __restrict__ y) {
  const Index half = dim / 2;
  for (Index p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x) {
    const Index j = p % half, row = p / half;  // row: token * heads + head
    const Index h = row % heads, token = row / heads;
    const Index bi = token / seq_len, si = token % seq_len;
    const int64_t pos = positions != nullptr ? positions[token] : si;
    const T* xr = x + bi * st.batch + si * st.seq + h * st.head;
    const T* c = cos + pos * dim;
    const T* s = sin + pos * dim;
    const float x1 = ToFloat(xr[j]), x2 = ToFloat(xr[j + half]);
    const float c1 = ToFloat(c[j]), c2 = ToFloat(c[j + half]), s1 = ToFloat(s[j]), s2 = ToFloat(s[j + half]);
    float y1, y2;
    if (!backward) {  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
      y1 = Round<T>(x1 * c1) + Round<T>(-x2 * s1);
      y2 = Round<T>(x2 * c2) + Round<T>(x1 * s2);
    } else {  // x * cos + rotate_half^T(x * sin), rotate_half^T(u) = [u2, -u1]
      y1 = Round<T>(x1 * c1) + Round<T>(x2 * s2);
      y2 = Round<T>(x2 * c2) - Round<T>(x1 * s1);
    }
    T* yr = y + row * dim;
    yr[j] = FromFloat<T>(y1);
    yr[j + half] = FromFloat<T>(y2);
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

const char* LaunchSwiGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f, int64_t in_ld,
                         void* out, void* stream) {
  if (rows * f == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    if (Packable<T>({f, in_ld}, {gate, up, out})) {
      SwiGluKernel<T, V><<<ElementwiseBlocks(rows * f / V, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          g, u, rows, f, in_ld, o);
    } else {
      SwiGluKernel<T, 1><<<ElementwiseBlocks(rows * f, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          g, u, rows, f, in_ld, o);
    }
  });
  return LastLaunchError();
}

const char* LaunchSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type, int64_t rows,
                             int64_t f, int64_t in_ld, int64_t out_ld, void* grad_gate, void* grad_up, void* stream) {
  if (rows * f == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* go = static_cast<const T*>(grad_out);
    const auto* ga = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* dg = static_cast<T*>(grad_gate);
    auto* du = static_cast<T*>(grad_up);
    if (Packable<T>({f, in_ld, out_ld}, {grad_out, gate, up, grad_gate, grad_up})) {
      SwiGluGradKernel<T, V><<<ElementwiseBlocks(rows * f / V, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          go, ga, u, rows, f, in_ld, out_ld, dg, du);
    } else {
      SwiGluGradKernel<T, 1><<<ElementwiseBlocks(rows * f, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          go, ga, u, rows, f, in_ld, out_ld, dg, du);
    }
  });
  return LastLaunchError();
}

const char* LaunchRope(const void* x, const int64_t* x_strides, const void* cos, const void* sin,
                       const int64_t* positions, ElementType type, int64_t batch, int64_t seq_len, int64_t heads,
                       int64_t dim, bool backward, void* y, void* stream) {
  const int64_t pairs = batch * seq_len * heads * (dim / 2);
  if (pairs == 0) return nullptr;
  const RopeStrides st{x_strides[0], x_strides[1], x_strides[2]};
  const bool narrow = batch * seq_len * heads * dim < (int64_t{1} << 31);
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    const auto s = static_cast<cudaStream_t>(stream);
    const unsigned blocks = ElementwiseBlocks(pairs, kElementwiseThreads);
    if (narrow) {
      RopeKernel<T, uint32_t><<<blocks, kElementwiseThreads, 0, s>>>(
          static_cast<const T*>(x), st, static_cast<const T*>(cos), static_cast<const T*>(sin), positions,
          static_cast<uint32_t>(pairs), static_cast<uint32_t>(seq_len), static_cast<uint32_t>(heads),
          static_cast<uint32_t>(dim), backward, static_cast<T*>(y));
    } else {
      RopeKernel<T, int64_t><<<blocks, kElementwiseThreads, 0, s>>>(
          static_cast<const T*>(x), st, static_cast<const T*>(cos), static_cast<const T*>(sin), positions, pairs,
          seq_len, heads, dim, backward, static_cast<T*>(y));
    }
  });
  return LastLaunchError();
}

}  // namespace kernels
}  // namespace lorastep
