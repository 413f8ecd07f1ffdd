#include "lib/kernels/sha256.h"

#include <cuda_runtime.h>

namespace lorastep {
namespace kernels {
namespace {

__constant__ uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

__device__ __forceinline__ uint32_t Rotr(uint32_t x, int n) { return __funnelshift_r(x, x, n); }

// One 64-byte block (16 big-endian words, overwritten as the message schedule).
__device__ void Compress(uint32_t h[8], uint32_t w[16]) {
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
#pragma unroll
  for (int t = 0; t < 64; ++t) {
    uint32_t wt;
    if (t < 16) {
      wt = w[t];
    } else {
      const uint32_t w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
      const uint32_t s0 = Rotr(w15, 7) ^ Rotr(w15, 18) ^ (w15 >> 3);
      const uint32_t s1 = Rotr(w2, 17) ^ Rotr(w2, 19) ^ (w2 >> 10);
      wt = w[t & 15] = w[t & 15] + s0 + w[(t - 7) & 15] + s1;
    }
    const uint32_t t1 = k + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + wt;
    const uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

// One thread per range: ranges are a few KiB and independent, so no cooperation is needed.
__global__ void RangeSha256Kernel(const int64_t* starts, const int64_t* sizes, int64_t count, uint8_t* digests) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(starts[i]);
  const int64_t len = sizes[i];
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint32_t w[16];
  const int64_t full = len / 64;
  const auto address = reinterpret_cast<uintptr_t>(p);
  for (int64_t blk = 0; blk < full; ++blk) {
    const uint8_t* q = p + blk * 64;
    if ((address & 15) == 0) {  // four 16-byte loads a block
      const uint4* q128 = reinterpret_cast<const uint4*>(q);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 v = __ldg(q128 + j);
        w[4 * j] = __byte_perm(v.x, 0, 0x0123), w[4 * j + 1] = __byte_perm(v.y, 0, 0x0123);
        w[4 * j + 2] = __byte_perm(v.z, 0, 0x0123), w[4 * j + 3] = __byte_perm(v.w, 0, 0x0123);
      }
    } else if ((address & 3) == 0) {
      const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
#pragma unroll
      for (int j = 0; j < 16; ++j) w[j] = __byte_perm(__ldg(q32 + j), 0, 0x0123);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        w[j] = (uint32_t(__ldg(q + 4 * j)) << 24) | (uint32_t(__ldg(q + 4 * j + 1)) << 16) |
               (uint32_t(__ldg(q + 4 * j + 2)) << 8) | uint32_t(__ldg(q + 4 * j + 3));
      }
    }
    Compress(h, w);
  }
  // The tail: remaining bytes, 0x80, zeros, the bit length (big-endian) in the last 8 bytes;
  // two blocks when the remainder leaves no room for the length.
  const int rem = static_cast<int>(len - full * 64);
  const uint8_t* tail = p + full * 64;
  const int blocks = rem + 1 + 8 <= 64 ? 1 : 2;
  const uint64_t bits = static_cast<uint64_t>(len) * 8;
  for (int blk = 0; blk < blocks; ++blk) {
    for (int j = 0; j < 16; ++j) {
      uint32_t word = 0;
      for (int b = 0; b < 4; ++b) {
        const int pos = blk * 64 + 4 * j + b;
        uint32_t byte = 0;
        if (pos < rem) {
          byte = tail[pos];
        } else if (pos == rem) {
          byte = 0x80;
        } else if (blk == blocks - 1 && pos >= blocks * 64 - 8) {
          byte = static_cast<uint32_t>((bits >> (8 * (blocks * 64 - 1 - pos))) & 0xff);
        }
        word = (word << 8) | byte;
      }
      w[j] = word;
    }
    Compress(h, w);
  }
  uint8_t* out = digests + 32 * i;
  for (int j = 0; j < 8; ++j) {
    out[4 * j] = h[j] >> 24, out[4 * j + 1] = (h[j] >> 16) & 0xff, out[4 * j + 2] = (h[j] >> 8) & 0xff,
    out[4 * j + 3] = h[j] & 0xff;
  }
}

}  // namespace

const char* LaunchRangeSha256(const int64_t* starts, const int64_t* sizes, int64_t count, uint8_t* digests,
                              void* stream) {
  if (count == 0) return nullptr;
  constexpr int kThreads = 64;  // few ranges: small blocks spread them over more SMs
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  RangeSha256Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      starts, sizes, count, digests);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace kernels
}  // namespace lorastep
