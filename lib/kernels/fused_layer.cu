#include "lib/kernels/fused_layer.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

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

__device__ __forceinline__ float Sigmoid(float v) { return 1.f / (1.f + expf(-v)); }
__device__ __forceinline__ float Silu(float v) { return v * Sigmoid(v); }

// Rows are read in packs of V elements (hidden and every pointer a multiple of the pack;
// V = 1 otherwise): the scalar form leaves most of the memory bandwidth unused.
// With `residual` non-null the normed row is x + residual (rounded to T, as an add that
// stores T would), and that sum is written to `sum`: the residual add costs no pass of its own.
// With `gate` non-null (Qwen3.5's gated norm) the output is (y * silu(gate)).to(T), the gate
// and the product in fp32.
template <typename T, int V>
__global__ void RmsNormKernel(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ gate,
                              const T* __restrict__ weight, int64_t hidden, float eps, T* __restrict__ sum_out,
                              T* __restrict__ y, int64_t y_ld, float* __restrict__ rstd) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x, packs = hidden / V;
  const T* xr = x + row * hidden;
  const T* rr = residual != nullptr ? residual + row * hidden : nullptr;
  T* sr = sum_out != nullptr ? sum_out + row * hidden : nullptr;
  auto load = [&](int64_t i) {
    Pack<T, V> p = Load<T, V>(xr, i);
    if (rr != nullptr) {
      const Pack<T, V> q = Load<T, V>(rr, i);
#pragma unroll
      for (int k = 0; k < V; ++k) p.v[k] = FromFloat<T>(ToFloat(p.v[k]) + ToFloat(q.v[k]));
    }
    return p;
  };
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, V> p = load(i);
    if (sr != nullptr) Store<T, V>(sr, i, p);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float v = ToFloat(p.v[k]);
      sum += v * v;
    }
  }
  sum = BlockSum(sum, scratch);
  const float r = rsqrtf(sum / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  T* yr = y + row * y_ld;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, V> xp = load(i), wp = Load<T, V>(weight, i);
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = FromFloat<T>(ToFloat(wp.v[k]) * Round<T>(ToFloat(xp.v[k]) * r));
    if (gate != nullptr) {
      const Pack<T, V> zp = Load<T, V>(gate + row * hidden, i);
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = FromFloat<T>(ToFloat(o.v[k]) * Silu(ToFloat(zp.v[k])));
    }
    Store<T, V>(yr, i, o);
  }
}

// dx = (gn - n * mean(gn * n)) * rstd with gn = (g * weight).to(T), plus `residual` (the
// gradient arriving at x along the residual stream) when non-null: the add then costs no pass
// of its own. With `gate` non-null (RmsNormKernel's gated form) g reaches the norm as
// (g * silu(gate)).to(T), and dgate = g * y_norm * silu'(gate) is written as well.
template <typename T, int V>
__global__ void RmsNormGradKernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ gate,
                                  const T* __restrict__ weight, const float* __restrict__ rstd,
                                  const T* __restrict__ residual, int64_t hidden, T* __restrict__ dx,
                                  T* __restrict__ dgate) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x, packs = hidden / V;
  const T* gr = g + row * hidden;
  const T* xr = x + row * hidden;
  const T* zr = gate != nullptr ? gate + row * hidden : nullptr;
  const float r = rstd[row];
  // The gradient reaching the norm's output ((weight * n).to(T)) for element k of a pack.
  auto arriving = [&](const Pack<T, V>& gp, const Pack<T, V>& zp, int k) {
    if (zr == nullptr) return ToFloat(gp.v[k]);
    const float z = ToFloat(zp.v[k]);
    return Round<T>(ToFloat(gp.v[k]) * Silu(z));
  };
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, V> gp = Load<T, V>(gr, i), xp = Load<T, V>(xr, i), wp = Load<T, V>(weight, i);
    const Pack<T, V> zp = zr != nullptr ? Load<T, V>(zr, i) : gp;
#pragma unroll
    for (int k = 0; k < V; ++k) dot += Round<T>(arriving(gp, zp, k) * ToFloat(wp.v[k])) * (ToFloat(xp.v[k]) * r);
    if (zr != nullptr) {
      Pack<T, V> dz;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float z = ToFloat(zp.v[k]), s = Sigmoid(z);
        const float normed = Round<T>(ToFloat(wp.v[k]) * Round<T>(ToFloat(xp.v[k]) * r));
        dz.v[k] = FromFloat<T>(ToFloat(gp.v[k]) * normed * s * (1.f + z * (1.f - s)));
      }
      Store<T, V>(dgate + row * hidden, i, dz);
    }
  }
  dot = BlockSum(dot, scratch) / static_cast<float>(hidden);
  T* out = dx + row * hidden;
  const T* res = residual != nullptr ? residual + row * hidden : nullptr;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, V> gp = Load<T, V>(gr, i), xp = Load<T, V>(xr, i), wp = Load<T, V>(weight, i);
    const Pack<T, V> zp = zr != nullptr ? Load<T, V>(zr, i) : gp;
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float gn = Round<T>(arriving(gp, zp, k) * ToFloat(wp.v[k]));
      const float n = ToFloat(xp.v[k]) * r;
      o.v[k] = FromFloat<T>((gn - n * dot) * r);
    }
    if (res != nullptr) {
      const Pack<T, V> rp = Load<T, V>(res, i);
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = FromFloat<T>(ToFloat(o.v[k]) + ToFloat(rp.v[k]));
    }
    Store<T, V>(out, i, o);
  }
}

// The gated activations over a gate half and an up half, each with the ATen composition's
// roundings (compute in fp32, round to T wherever the composition stores a tensor).
// Forward(a, u): the output for gate a and up u; Backward(d, a, u, ...): the gradients for
// gate and up of the output's gradient d, and the output itself (backward may rewrite it).
struct SiluGate {  // silu(gate) * up
  template <typename T>
  __device__ __forceinline__ float Forward(float a, float u) const {
    return Round<T>(a / (1.f + expf(-a))) * u;
  }
  template <typename T>
  __device__ __forceinline__ void Backward(float d, float a, float u, float& dg, float& du, float& y) const {
    const float s = Sigmoid(a);
    const float dy = Round<T>(d * u);
    const float silu = Round<T>(a / (1.f + expf(-a)));  // as Forward rounds it
    dg = dy * s * (1.f + a * (1.f - s));
    du = d * silu;
    y = silu * u;
  }
};

// gpt-oss's clamped form: g = min(gate, limit), u = clamp(up, -limit, limit),
// s = sigmoid((g * alpha).to(T)).to(T), out = ((u + 1).to(T) * (g * s).to(T)).to(T); its
// gradient as autograd forms it through that composition (the gate's two paths summed, then
// rounded), zero where a clamp held the input.
struct ClampedSiluGate {
  float alpha, limit;
  template <typename T>
  __device__ __forceinline__ float Forward(float a, float up) const {
    const float g = fminf(a, limit), u = fminf(fmaxf(up, -limit), limit);
    const float s = Round<T>(Sigmoid(Round<T>(g * alpha)));
    return Round<T>(u + 1.f) * Round<T>(g * s);
  }
  template <typename T>
  __device__ __forceinline__ void Backward(float d, float a, float up, float& dg, float& du, float& y) const {
    const float g = fminf(a, limit), u = fminf(fmaxf(up, -limit), limit);
    const float s = Round<T>(Sigmoid(Round<T>(g * alpha)));
    const float gs = Round<T>(g * s), u1 = Round<T>(u + 1.f);
    const float d_u1 = Round<T>(d * gs), d_gs = Round<T>(d * u1);
    const float d_ga = Round<T>(Round<T>(d_gs * g) * (1.f - s) * s);
    dg = a <= limit ? Round<T>(Round<T>(d_gs * s) + Round<T>(d_ga * alpha)) : 0.f;
    du = up >= -limit && up <= limit ? d_u1 : 0.f;
    y = u1 * gs;
  }
};

// rows x f elements in packs of V (f, the strides and every pointer a multiple of the pack):
// gate/up rows `in_ld` apart (gate_up's halves: up = gate + f, in_ld = 2f), out contiguous.
template <typename T, int V, typename Act>
__global__ void GluKernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t rows, int64_t f,
                          int64_t in_ld, Act act, T* __restrict__ out) {
  const int64_t packs_per_row = f / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * packs_per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs_per_row, c = i % packs_per_row;
    const int64_t in = (r * in_ld) / V + c;
    const Pack<T, V> g = Load<T, V>(gate, in), u = Load<T, V>(up, in);
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = FromFloat<T>(act.template Forward<T>(ToFloat(g.v[k]), ToFloat(u.v[k])));
    Store<T, V>(out, i, o);
  }
}

// grad_gate/grad_up rows `out_ld` apart (the halves of gate_up's gradient: out_ld = 2f); the
// output into `y` (contiguous) when non-null.
template <typename T, int V, typename Act>
__global__ void GluGradKernel(const T* __restrict__ g, const T* __restrict__ gate, const T* __restrict__ up,
                              int64_t rows, int64_t f, int64_t in_ld, int64_t out_ld, Act act,
                              T* __restrict__ grad_gate, T* __restrict__ grad_up, T* __restrict__ y) {
  const int64_t packs_per_row = f / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * packs_per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs_per_row, c = i % packs_per_row;
    const int64_t in = (r * in_ld) / V + c, out = (r * out_ld) / V + c;
    const Pack<T, V> gp = Load<T, V>(g, i), ap = Load<T, V>(gate, in), up_p = Load<T, V>(up, in);
    Pack<T, V> dg, du, yp;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float dgk, duk, yk;
      act.template Backward<T>(ToFloat(gp.v[k]), ToFloat(ap.v[k]), ToFloat(up_p.v[k]), dgk, duk, yk);
      dg.v[k] = FromFloat<T>(dgk);
      du.v[k] = FromFloat<T>(duk);
      yp.v[k] = FromFloat<T>(yk);
    }
    Store<T, V>(grad_gate, out, dg);
    Store<T, V>(grad_up, out, du);
    if (y != nullptr) Store<T, V>(y, i, yp);
  }
}

// Strides of x in elements along batch, seq and heads (unit stride along dim).
struct RopeStrides {
  int64_t batch, seq, head;
};

// One thread per V pairs (j..j+V-1 with their partners j + dim/2): both halves from the
// same loads. Index is 32-bit when the tensor allows (integer division dominated the 64-bit
// version); V > 1 needs dim/2, the strides and every pointer in whole packs (the scalar
// form is bandwidth-starved, as above).
template <typename T, int V, typename Index>
__global__ void RopeKernel(const T* __restrict__ x, RopeStrides st, const T* __restrict__ cos,
                           const T* __restrict__ sin, const int64_t* __restrict__ positions, Index packs,
                           Index seq_len, Index heads, Index dim, bool backward, int64_t y_token_stride,
                           T* __restrict__ y) {
  const Index half = dim / 2, per_row = half / V;
  for (Index p = blockIdx.x * blockDim.x + threadIdx.x; p < packs; p += gridDim.x * blockDim.x) {
    const Index j = (p % per_row) * V, row = p / per_row;  // row: token * heads + head
    const Index h = row % heads, token = row / heads;
    const Index bi = token / seq_len, si = token % seq_len;
    const int64_t pos = positions != nullptr ? positions[token] : si;
    const int64_t xo = bi * st.batch + si * st.seq + h * st.head + j, co = pos * dim + j;
    const Pack<T, V> x1 = Load<T, V>(x + xo, 0), x2 = Load<T, V>(x + xo + half, 0);
    const Pack<T, V> c1 = Load<T, V>(cos + co, 0), c2 = Load<T, V>(cos + co + half, 0);
    const Pack<T, V> s1 = Load<T, V>(sin + co, 0), s2 = Load<T, V>(sin + co + half, 0);
    Pack<T, V> o1, o2;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = ToFloat(x1.v[k]), b = ToFloat(x2.v[k]);
      float y1, y2;
      if (!backward) {  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        y1 = Round<T>(a * ToFloat(c1.v[k])) + Round<T>(-b * ToFloat(s1.v[k]));
        y2 = Round<T>(b * ToFloat(c2.v[k])) + Round<T>(a * ToFloat(s2.v[k]));
      } else {  // x * cos + rotate_half^T(x * sin), rotate_half^T(u) = [u2, -u1]
        y1 = Round<T>(a * ToFloat(c1.v[k])) + Round<T>(b * ToFloat(s2.v[k]));
        y2 = Round<T>(b * ToFloat(c2.v[k])) - Round<T>(a * ToFloat(s1.v[k]));
      }
      o1.v[k] = FromFloat<T>(y1);
      o2.v[k] = FromFloat<T>(y2);
    }
    T* yr = y + static_cast<int64_t>(token) * y_token_stride + static_cast<int64_t>(h) * dim + j;
    Store<T, V>(yr, 0, o1);
    Store<T, V>(yr + half, 0, o2);
  }
}

constexpr int kElementwiseThreads = 256;

const char* LaunchNorm(const void* x, const void* residual, const void* gate, const void* weight, ElementType type,
                       int64_t rows, int64_t hidden, float eps, void* sum, void* y, int64_t y_ld, float* rstd,
                       void* stream) {
  if (rows == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* xp = static_cast<const T*>(x);
    const auto* rp = static_cast<const T*>(residual);
    const auto* zp = static_cast<const T*>(gate);
    const auto* wp = static_cast<const T*>(weight);
    auto* sp = static_cast<T*>(sum);
    auto* yp = static_cast<T*>(y);
    const auto blocks = static_cast<unsigned>(rows);
    if (Packable<T>({hidden, y_ld}, {x, residual, gate, weight, sum, y})) {
      RmsNormKernel<T, V><<<blocks, RowThreads(hidden / V), 0, s>>>(xp, rp, zp, wp, hidden, eps, sp, yp, y_ld, rstd);
    } else {
      RmsNormKernel<T, 1><<<blocks, RowThreads(hidden), 0, s>>>(xp, rp, zp, wp, hidden, eps, sp, yp, y_ld, rstd);
    }
  });
  return LastLaunchError();
}

const char* LaunchNormGrad(const void* grad_y, const void* x, const void* gate, const void* weight, const float* rstd,
                           const void* residual_grad, ElementType type, int64_t rows, int64_t hidden, void* grad_x,
                           void* grad_gate, void* stream) {
  if (rows == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* gp = static_cast<const T*>(grad_y);
    const auto* xp = static_cast<const T*>(x);
    const auto* zp = static_cast<const T*>(gate);
    const auto* wp = static_cast<const T*>(weight);
    const auto* rp = static_cast<const T*>(residual_grad);
    auto* dp = static_cast<T*>(grad_x);
    auto* dzp = static_cast<T*>(grad_gate);
    const auto blocks = static_cast<unsigned>(rows);
    if (Packable<T>({hidden}, {grad_y, x, weight, grad_x}) && Packable<T>({}, {residual_grad, gate, grad_gate})) {
      RmsNormGradKernel<T, V><<<blocks, RowThreads(hidden / V), 0, s>>>(gp, xp, zp, wp, rstd, rp, hidden, dp, dzp);
    } else {
      RmsNormGradKernel<T, 1><<<blocks, RowThreads(hidden), 0, s>>>(gp, xp, zp, wp, rstd, rp, hidden, dp, dzp);
    }
  });
  return LastLaunchError();
}

}  // namespace

const char* LaunchRmsNorm(const void* x, const void* residual, const void* weight, ElementType type, int64_t rows,
                          int64_t hidden, float eps, void* sum, void* y, int64_t y_ld, float* rstd, void* stream) {
  return LaunchNorm(x, residual, nullptr, weight, type, rows, hidden, eps, sum, y, y_ld, rstd, stream);
}

const char* LaunchRmsNormGrad(const void* grad_y, const void* x, const void* weight, const float* rstd,
                              const void* residual_grad, ElementType type, int64_t rows, int64_t hidden,
                              void* grad_x, void* stream) {
  return LaunchNormGrad(grad_y, x, nullptr, weight, rstd, residual_grad, type, rows, hidden, grad_x, nullptr, stream);
}

const char* LaunchGatedRmsNorm(const void* x, const void* z, const void* weight, ElementType type, int64_t rows,
                               int64_t hidden, float eps, void* y, float* rstd, void* stream) {
  return LaunchNorm(x, nullptr, z, weight, type, rows, hidden, eps, nullptr, y, hidden, rstd, stream);
}

const char* LaunchGatedRmsNormGrad(const void* grad_y, const void* x, const void* z, const void* weight,
                                   const float* rstd, ElementType type, int64_t rows, int64_t hidden, void* grad_x,
                                   void* grad_z, void* stream) {
  return LaunchNormGrad(grad_y, x, z, weight, rstd, nullptr, type, rows, hidden, grad_x, grad_z, stream);
}

namespace {

template <typename Act>
const char* LaunchGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f, int64_t in_ld,
                      Act act, void* out, void* stream) {
  if (rows * f == 0) return nullptr;
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    if (Packable<T>({f, in_ld}, {gate, up, out})) {
      GluKernel<T, V><<<ElementwiseBlocks(rows * f / V, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          g, u, rows, f, in_ld, act, o);
    } else {
      GluKernel<T, 1><<<ElementwiseBlocks(rows * f, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          g, u, rows, f, in_ld, act, o);
    }
  });
  return LastLaunchError();
}

template <typename Act>
const char* LaunchGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type, int64_t rows,
                          int64_t f, int64_t in_ld, int64_t out_ld, Act act, void* grad_gate, void* grad_up, void* y,
                          void* stream) {
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
    auto* yp = static_cast<T*>(y);
    if (Packable<T>({f, in_ld, out_ld}, {grad_out, gate, up, grad_gate, grad_up, y})) {
      GluGradKernel<T, V><<<ElementwiseBlocks(rows * f / V, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          go, ga, u, rows, f, in_ld, out_ld, act, dg, du, yp);
    } else {
      GluGradKernel<T, 1><<<ElementwiseBlocks(rows * f, kElementwiseThreads), kElementwiseThreads, 0, s>>>(
          go, ga, u, rows, f, in_ld, out_ld, act, dg, du, yp);
    }
  });
  return LastLaunchError();
}

}  // namespace

const char* LaunchSwiGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f, int64_t in_ld,
                         void* out, void* stream) {
  return LaunchGlu(gate, up, type, rows, f, in_ld, SiluGate{}, out, stream);
}

const char* LaunchSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type, int64_t rows,
                             int64_t f, int64_t in_ld, int64_t out_ld, void* grad_gate, void* grad_up, void* act,
                             void* stream) {
  return LaunchGluGrad(grad_out, gate, up, type, rows, f, in_ld, out_ld, SiluGate{}, grad_gate, grad_up, act, stream);
}

const char* LaunchClampedSwiGlu(const void* gate, const void* up, ElementType type, int64_t rows, int64_t f,
                                int64_t in_ld, float alpha, float limit, void* out, void* stream) {
  return LaunchGlu(gate, up, type, rows, f, in_ld, ClampedSiluGate{alpha, limit}, out, stream);
}

const char* LaunchClampedSwiGluGrad(const void* grad_out, const void* gate, const void* up, ElementType type,
                                    int64_t rows, int64_t f, int64_t in_ld, int64_t out_ld, float alpha, float limit,
                                    void* grad_gate, void* grad_up, void* stream) {
  return LaunchGluGrad(grad_out, gate, up, type, rows, f, in_ld, out_ld, ClampedSiluGate{alpha, limit}, grad_gate,
                       grad_up, /*y=*/nullptr, stream);
}

const char* LaunchRope(const void* x, const int64_t* x_strides, const void* cos, const void* sin,
                       const int64_t* positions, ElementType type, int64_t batch, int64_t seq_len, int64_t heads,
                       int64_t dim, bool backward, void* y, int64_t y_token_stride, void* stream) {
  const int64_t pairs = batch * seq_len * heads * (dim / 2);
  if (pairs == 0) return nullptr;
  const RopeStrides st{x_strides[0], x_strides[1], x_strides[2]};
  const bool narrow = batch * seq_len * heads * dim < (int64_t{1} << 31);
  DispatchElementType(type, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const auto s = static_cast<cudaStream_t>(stream);
    const auto* xp = static_cast<const T*>(x);
    const auto* cp = static_cast<const T*>(cos);
    const auto* sp = static_cast<const T*>(sin);
    auto* yp = static_cast<T*>(y);
    // Queries and keys are column slices of one projection: whole packs whenever dim/2 and
    // the strides are (Qwen and Llama heads of 64 or 128 are).
    const bool packed = Packable<T>({dim / 2, st.batch, st.seq, st.head, y_token_stride}, {x, cos, sin, y});
    const int64_t packs = packed ? pairs / V : pairs;
    const unsigned blocks = ElementwiseBlocks(packs, kElementwiseThreads);
    auto launch = [&](auto v, auto index) {
      constexpr int kV = decltype(v)::value;
      using Index = decltype(index);
      RopeKernel<T, kV, Index><<<blocks, kElementwiseThreads, 0, s>>>(
          xp, st, cp, sp, positions, static_cast<Index>(packs), static_cast<Index>(seq_len),
          static_cast<Index>(heads), static_cast<Index>(dim), backward, y_token_stride, yp);
    };
    if (packed && narrow) launch(std::integral_constant<int, V>{}, uint32_t{});
    else if (packed) launch(std::integral_constant<int, V>{}, int64_t{});
    else if (narrow) launch(std::integral_constant<int, 1>{}, uint32_t{});
    else launch(std::integral_constant<int, 1>{}, int64_t{});
  });
  return LastLaunchError();
}

}  // namespace kernels
}  // namespace lorastep
