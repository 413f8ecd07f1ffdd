#include "lib/kernels/paged_decode.h"

#include <algorithm>
#include <type_traits>

#include "lib/kernels/cuda_math.cuh"

namespace lorastep {
namespace kernels {
namespace {

constexpr int kWarps = 4;   // per thread block, each over every kWarps-th run of positions
constexpr int kUnroll = 4;  // positions whose keys and values a warp loads before using any
constexpr int kMinSplitLength = 256;  // positions per part, at least, when a sequence is split

// One thread block per (sequence, key/value head, part): each lane holds E = head_dim / 32
// consecutive elements of the G query heads that share the key/value head, and per query
// head the online softmax's running max m, sum l of e^(score - m) and its elements of
// sum e^(score - m) v. The warps' states are combined in shared memory; with one part the
// block writes the output, else its part's (m, l, unnormalized sum) for CombineParts.
template <typename T, int E, int G>
__global__ void __launch_bounds__(kWarps * 32)
    PagedDecodeKernel(const T* __restrict__ q, const T* __restrict__ keys, const T* __restrict__ values,
                      const int32_t* __restrict__ table, int64_t table_stride, const int32_t* __restrict__ lengths,
                      int block_size, int kv_heads, int group, int window, float scale, int split_length,
                      float* __restrict__ part, T* __restrict__ out) {
  constexpr int D = 32 * E;
  const int s = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int heads = kv_heads * group;
  const int first = window > 0 ? max(0, lengths[s] - window) : 0;  // a sliding layer's oldest key
  const int begin = max(first, split * split_length);
  const int end = min(lengths[s], split * split_length + split_length);
  float qr[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    Pack<T, E> p{};
    if (g < group) p = Load<T, E>(q + (static_cast<int64_t>(s) * heads + h * group + g) * D, lane);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qr[g][e] = g < group ? ToFloat(p.v[e]) * scale : 0.f;
      acc[g][e] = 0.f;
    }
  }
  const int32_t* blocks = table + static_cast<int64_t>(s) * table_stride;
  const int64_t slot_stride = static_cast<int64_t>(kv_heads) * D;
  for (int p0 = begin + warp * kUnroll; p0 < end; p0 += kWarps * kUnroll) {
    Pack<T, E> kp[kUnroll], vp[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u;
      if (p < end) {
        const int64_t slot = static_cast<int64_t>(blocks[p / block_size]) * block_size + p % block_size;
        const int64_t base = slot * slot_stride + static_cast<int64_t>(h) * D;
        kp[u] = Load<T, E>(keys + base, lane);
        vp[u] = Load<T, E>(values + base, lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p0 + u >= end) break;  // the same for the whole warp
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= group) break;
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += qr[g][e] * ToFloat(kp[u].v[e]);
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
        const float m_new = fmaxf(m[g], dot);
        const float corr = expf(m[g] - m_new);  // 0 while m was -inf
        const float w = expf(dot - m_new);
        l[g] = l[g] * corr + w;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + w * ToFloat(vp[u].v[e]);
        m[g] = m_new;
      }
    }
  }
  __shared__ float warp_m[kWarps][G], warp_l[kWarps][G];
  __shared__ float warp_acc[kWarps][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) warp_acc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float top = -INFINITY;
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, warp_m[w][g]);
    float sum = 0.f, weighted = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      if (warp_m[w][g] == -INFINITY) continue;
      const float f = expf(warp_m[w][g] - top);
      sum += warp_l[w][g] * f;
      weighted += warp_acc[w][g][d] * f;
    }
    const int64_t head = static_cast<int64_t>(s) * heads + h * group + g;
    if (splits == 1) {
      out[head * D + d] = FromFloat<T>(sum > 0.f ? weighted / sum : 0.f);
    } else {
      float* mine = part + (head * splits + split) * (D + 2);
      mine[2 + d] = weighted;
      if (d == 0) {
        mine[0] = top;
        mine[1] = sum;
      }
    }
  }
}

// One thread block per query head, one thread per element: the parts' states combined.
template <typename T>
__global__ void CombineParts(const float* __restrict__ part, int splits, T* __restrict__ out) {
  const int D = blockDim.x, d = threadIdx.x;
  const int64_t head = blockIdx.x;
  const float* parts = part + head * splits * (D + 2);
  float top = -INFINITY;
  for (int k = 0; k < splits; ++k) top = fmaxf(top, parts[k * (D + 2)]);
  float sum = 0.f, weighted = 0.f;
  for (int k = 0; k < splits; ++k) {
    const float mk = parts[k * (D + 2)];
    if (mk == -INFINITY) continue;
    const float f = expf(mk - top);
    sum += parts[k * (D + 2) + 1] * f;
    weighted += parts[k * (D + 2) + 2 + d] * f;
  }
  out[head * D + d] = FromFloat<T>(sum > 0.f ? weighted / sum : 0.f);
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Int<E>{}, Int<G>{}) for head_dim = 32 E and the smallest G >= group.
template <typename F>
void DispatchShape(int64_t group, int64_t head_dim, F&& f) {
  auto with_e = [&](auto e) {
    if (group <= 1) {
      f(e, Int<1>{});
    } else if (group <= 2) {
      f(e, Int<2>{});
    } else if (group <= 4) {
      f(e, Int<4>{});
    } else {
      f(e, Int<8>{});
    }
  };
  if (head_dim == 64) {
    with_e(Int<2>{});
  } else if (head_dim == 128) {
    with_e(Int<4>{});
  } else {
    with_e(Int<8>{});
  }
}

int MultiprocessorCount() {
  static const int count = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) {
      cudaGetLastError();  // not this call's error to report
      return 100;
    }
    return n;
  }();
  return count;
}

}  // namespace

bool PagedDecodeSupported(int64_t group, int64_t head_dim) {
  return group >= 1 && group <= 8 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

PagedDecodePlan PlanPagedDecode(int64_t sequences, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t max_length) {
  PagedDecodePlan plan;
  const int64_t blocks = std::max<int64_t>(1, sequences * kv_heads);
  // About four thread blocks per multiprocessor: fewer leave it idle while a block waits on
  // its loads; a part shorter than kMinSplitLength costs more to combine than it saves.
  const int64_t wanted = (4 * MultiprocessorCount() + blocks - 1) / blocks;
  plan.splits = std::max<int64_t>(1, std::min(wanted, max_length / kMinSplitLength));
  plan.split_length = (std::max<int64_t>(1, max_length) + plan.splits - 1) / plan.splits;
  plan.workspace_floats = plan.splits > 1 ? sequences * kv_heads * group * plan.splits * (head_dim + 2) : 0;
  return plan;
}

const char* LaunchPagedDecode(const void* q, const void* keys, const void* values, ElementType type,
                              const int32_t* table, int64_t table_stride, const int32_t* lengths,
                              int64_t sequences, int64_t kv_heads, int64_t group, int64_t head_dim,
                              int64_t block_size, int64_t window, float scale, const PagedDecodePlan& plan,
                              float* workspace, void* out, void* stream) {
  if (!PagedDecodeSupported(group, head_dim)) return "paged decode: head shape not supported";
  if (sequences == 0) return nullptr;
  auto st = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(sequences), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(plan.splits));
  DispatchElementType(type, [&](auto zero) {
    using T = decltype(zero);
    DispatchShape(group, head_dim, [&](auto e, auto g) {
      PagedDecodeKernel<T, decltype(e)::value, decltype(g)::value><<<grid, kWarps * 32, 0, st>>>(
          static_cast<const T*>(q), static_cast<const T*>(keys), static_cast<const T*>(values), table, table_stride,
          lengths, static_cast<int>(block_size), static_cast<int>(kv_heads), static_cast<int>(group),
          static_cast<int>(window), scale,
          static_cast<int>(plan.split_length), workspace, static_cast<T*>(out));
    });
    if (plan.splits > 1) {
      CombineParts<T><<<static_cast<unsigned>(sequences * kv_heads * group), static_cast<unsigned>(head_dim), 0, st>>>(
          workspace, static_cast<int>(plan.splits), static_cast<T*>(out));
    }
  });
  return LastLaunchError();
}

}  // namespace kernels
}  // namespace lorastep
