#include "lib/kernels/token_scores.h"

#include <cmath>

#include "lib/kernels/cuda_math.cuh"

namespace lorastep {
namespace kernels {
namespace {

constexpr int kThreads = 1024;

// Running (max m, sum of e^(z-m) s, sum of e^(z-m) z t) of a set of logits.
struct Stats {
  float m, s, t;
};

__device__ __forceinline__ Stats Combine(Stats a, Stats b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  const float ea = expf(a.m - m), eb = expf(b.m - m);
  return {m, a.s * ea + b.s * eb, a.t * ea + b.t * eb};
}

__device__ __forceinline__ Stats Push(Stats a, float z) {
  if (z > a.m) {
    const float scale = a.m == -INFINITY ? 0.f : expf(a.m - z);
    return {z, a.s * scale + 1.f, a.t * scale + z};
  }
  const float e = expf(z - a.m);
  return {a.m, a.s + e, a.t + e * z};
}

// V: elements per load (16-byte packs where the row stride and vocab allow; element-sized
// loads leave most of the bandwidth unused).
template <typename T, int V>
__global__ void TokenScoresKernel(const T* __restrict__ logits, int64_t vocab, int64_t row_stride,
                                  const int64_t* __restrict__ targets, float* __restrict__ logprobs,
                                  float* __restrict__ entropy, float* __restrict__ lse_out,
                                  T* __restrict__ probs, T* __restrict__ probs_logprobs) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * row_stride;
  Stats st{-INFINITY, 0.f, 0.f};
  // Four loads in flight per thread before any is used (one at a time is latency-bound);
  // each thread still sees its elements in the same order.
  constexpr int kUnroll = 4;
  const int64_t packs = vocab / V;
  int64_t v = threadIdx.x;
  for (; v + (kUnroll - 1) * kThreads < packs; v += kUnroll * kThreads) {
    Pack<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p[u] = Load<T, V>(z, v + u * kThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) st = Push(st, ToFloat(p[u].v[k]));
    }
  }
  for (; v < packs; v += kThreads) {
    const Pack<T, V> p = Load<T, V>(z, v);
#pragma unroll
    for (int k = 0; k < V; ++k) st = Push(st, ToFloat(p.v[k]));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    Stats other{__shfl_xor_sync(0xffffffff, st.m, offset), __shfl_xor_sync(0xffffffff, st.s, offset),
                __shfl_xor_sync(0xffffffff, st.t, offset)};
    st = Combine(st, other);
  }
  __shared__ Stats warp_stats[kThreads / 32];
  __shared__ float row_lse;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kThreads / 32 ? warp_stats[lane] : Stats{-INFINITY, 0.f, 0.f};
    for (int offset = 16; offset > 0; offset >>= 1) {
      Stats other{__shfl_xor_sync(0xffffffff, st.m, offset), __shfl_xor_sync(0xffffffff, st.s, offset),
                  __shfl_xor_sync(0xffffffff, st.t, offset)};
      st = Combine(st, other);
    }
    if (lane == 0) {
      const float lse = st.m + logf(st.s);
      row_lse = lse;
      if (lse_out != nullptr) lse_out[row] = lse;
      logprobs[row] = ToFloat(z[targets[row]]) - lse;
      entropy[row] = lse - st.t / st.s;
    }
  }
  if (probs == nullptr) return;
  __syncthreads();
  const float lse = row_lse;
  T* p_row = probs + row * vocab;
  T* plp_row = probs_logprobs != nullptr ? probs_logprobs + row * vocab : nullptr;
  for (int64_t v = threadIdx.x; v < vocab / V; v += kThreads) {
    const Pack<T, V> zp = Load<T, V>(z, v);
    Pack<T, V> pp, plp;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float lp = ToFloat(zp.v[k]) - lse;
      const float p = expf(lp);
      pp.v[k] = FromFloat<T>(p);
      plp.v[k] = FromFloat<T>(p * lp);
    }
    Store<T, V>(p_row, v, pp);
    if (plp_row != nullptr) Store<T, V>(plp_row, v, plp);
  }
}

template <typename T, int V>
__global__ void TokenScoresGradKernel(const T* __restrict__ logits, int64_t vocab, int64_t row_stride,
                                      const int64_t* __restrict__ targets, const float* __restrict__ lse,
                                      const float* __restrict__ entropy, const float* __restrict__ g_lp,
                                      const float* __restrict__ g_ent, T* __restrict__ grad) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * row_stride;
  T* out = grad + row * vocab;
  const float row_lse = lse[row], ent = entropy[row];
  const float a = g_lp != nullptr ? g_lp[row] : 0.f, b = g_ent != nullptr ? g_ent[row] : 0.f;
  const int64_t target = targets[row];
  for (int64_t v = threadIdx.x; v < vocab / V; v += kThreads) {
    const Pack<T, V> zp = Load<T, V>(z, v);
    Pack<T, V> gp;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float lp = ToFloat(zp.v[k]) - row_lse;
      float g = -expf(lp) * (a + b * (lp + ent));
      if (v * V + k == target) g += a;
      gp.v[k] = FromFloat<T>(g);
    }
    Store<T, V>(out, v, gp);
  }
}

template <typename T>
void Launch(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride, const int64_t* targets,
            float* logprobs, float* entropy, float* lse_out, void* probs, void* probs_logprobs,
            cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  if (Packable<T>({vocab, row_stride}, {logits, probs, probs_logprobs})) {
    TokenScoresKernel<T, V><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab, row_stride, targets, logprobs, entropy, lse_out,
        static_cast<T*>(probs), static_cast<T*>(probs_logprobs));
  } else {
    TokenScoresKernel<T, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab, row_stride, targets, logprobs, entropy, lse_out,
        static_cast<T*>(probs), static_cast<T*>(probs_logprobs));
  }
}

template <typename T>
void LaunchGrad(const void* logits, int64_t rows, int64_t vocab, int64_t row_stride, const int64_t* targets,
                const float* lse, const float* entropy, const float* g_lp, const float* g_ent, void* grad,
                cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  if (Packable<T>({vocab, row_stride}, {logits, grad})) {
    TokenScoresGradKernel<T, V><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab, row_stride, targets, lse, entropy, g_lp, g_ent, static_cast<T*>(grad));
  } else {
    TokenScoresGradKernel<T, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab, row_stride, targets, lse, entropy, g_lp, g_ent, static_cast<T*>(grad));
  }
}

}  // namespace

const char* LaunchTokenScores(const void* logits, ElementType type, int64_t rows, int64_t vocab,
                              int64_t row_stride, const int64_t* targets, float* logprobs,
                              float* entropy, float* lse_out, void* probs, void* probs_logprobs,
                              void* stream) {
  if (rows == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  DispatchElementType(type, [&](auto t) { Launch<decltype(t)>(logits, rows, vocab, row_stride, targets, logprobs, entropy, lse_out, probs, probs_logprobs, s); });
  return LastLaunchError();
}

const char* LaunchTokenScoresGrad(const void* logits, ElementType type, int64_t rows, int64_t vocab,
                                  int64_t row_stride, const int64_t* targets, const float* lse,
                                  const float* entropy, const float* g_lp, const float* g_ent,
                                  void* grad, void* stream) {
  if (rows == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  DispatchElementType(type, [&](auto t) { LaunchGrad<decltype(t)>(logits, rows, vocab, row_stride, targets, lse, entropy, g_lp, g_ent, grad, s); });
  return LastLaunchError();
}

}  // namespace kernels
}  // namespace lorastep
