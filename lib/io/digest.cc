#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <functional>
#include <tuple>
#include <memory>
#include <thread>

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/kernel_launch.h"
#include "lib/kernels/sha256.h"
#endif

namespace lorastep {
namespace {

// The unit of parallel hashing: small enough that an adapter is thousands of independent
// ranges for the GPU's threads (LaunchRangeSha256) or the host's; larger chunks leave too
// few ranges to spread (docs/PERFORMANCE.md, the digest's cost).
constexpr int64_t kChunkBytes = int64_t{16} << 10;

using Sha256 = std::array<unsigned char, 32>;

class Hasher {
 public:
  Hasher() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) { EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr); }
  void Update(const void* data, size_t n) { EVP_DigestUpdate(ctx_.get(), data, n); }
  Sha256 Final() {
    Sha256 out{};
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_.get(), out.data(), &len);
    return out;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

// Every tensor's bytes in chunks of at most kChunkBytes; the digest hashes each tensor's
// dtype, shape and chunk digests in order. Chunks of every tensor lie in one flat list
// (tensor i's are [first[i], first[i + 1])): an adapter is over a thousand small tensors, and
// per-tensor allocations and calls, not the hashing, bound a digest of many runs.
struct ChunkList {
  std::vector<int64_t> first;  // per tensor, and one past the last
  std::vector<Sha256> digest;  // per chunk
  int64_t Size(const std::vector<const at::Tensor*>& tensors, int64_t c, size_t i) const {
    return std::min(kChunkBytes, Bytes(*tensors[i]) - (c - first[i]) * kChunkBytes);
  }
  static int64_t Bytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
};

ChunkList SplitIntoChunks(const std::vector<const at::Tensor*>& tensors) {
  ChunkList chunks;
  chunks.first.reserve(tensors.size() + 1);
  int64_t count = 0;
  for (const at::Tensor* t : tensors) {
    chunks.first.push_back(count);
    count += (ChunkList::Bytes(*t) + kChunkBytes - 1) / kChunkBytes;
  }
  chunks.first.push_back(count);
  chunks.digest.resize(static_cast<size_t>(count));
  return chunks;
}

// Runs fn(k) for every k < n on up to 16 threads (the caller's alone when `parallel` is false
// or n < 2).
void ForEachOnThreads(size_t n, bool parallel, const std::function<void(size_t)>& fn) {
  const size_t threads =
      parallel ? std::min<size_t>(n, std::max(1u, std::min(16u, std::thread::hardware_concurrency()))) : 1;
  if (threads <= 1) {
    for (size_t k = 0; k < n; ++k) fn(k);
    return;
  }
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t k = t; k < n; k += threads) fn(k);
    });
  }
  for (auto& th : pool) th.join();
}

#ifdef LORASTEP_WITH_CUDA_KERNELS
// Fills the chunk digests of the device tensors `members` on the device, reading each tensor
// where it lies (no copy of the bytes): one kernel over every member's chunks, whatever
// buffers they are in (several runs' adapters after a joint step fill the GPU together).
// The chunk table goes up and the digests come back through page-locked buffers, with one
// wait for all of them.
void HashOnDevice(const std::vector<const at::Tensor*>& tensors, const std::vector<size_t>& members,
                  ChunkList* chunks) {
  std::deque<at::Tensor> kept;  // contiguous copies of strided members (alive until the wait)
  std::vector<const at::Tensor*> contiguous(members.size());
  int64_t count = 0;
  for (size_t k = 0; k < members.size(); ++k) {
    const at::Tensor* t = tensors[members[k]];
    if (t->numel() > 0 && !t->is_contiguous()) {
      kept.push_back(t->detach().contiguous());
      t = &kept.back();
    }
    contiguous[k] = t;
    if (t->numel() > 0) count += chunks->first[members[k] + 1] - chunks->first[members[k]];
  }
  if (count == 0) return;
  const at::Tensor& any = *tensors[members.front()];
  // One table: every chunk's start address, then every chunk's size.
  const at::Tensor table = kernels::HostTable(2 * count);
  int64_t* starts = table.data_ptr<int64_t>();
  int64_t* sizes = starts + count;
  int64_t n = 0;
  for (size_t k = 0; k < members.size(); ++k) {
    const at::Tensor* t = contiguous[k];
    if (t->numel() == 0) continue;
    auto at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data_ptr()));
    for (int64_t left = ChunkList::Bytes(*t); left > 0; left -= kChunkBytes, at += kChunkBytes, ++n) {
      starts[n] = at;
      sizes[n] = std::min(kChunkBytes, left);
    }
  }
  const at::Tensor on_device = table.to(any.device(), /*non_blocking=*/true);  // read before the wait below
  const at::Tensor digests = at::empty({count, 32}, any.options().dtype(at::kByte));
  kernels::KernelLaunch launch(any);
  const int64_t* table_on_device = on_device.data_ptr<int64_t>();
  kernels::CheckLaunch(kernels::LaunchRangeSha256(table_on_device, table_on_device + count, count,
                                                  digests.data_ptr<uint8_t>(), launch.stream),
                       "sha256");
  const at::Tensor host = at::empty(digests.sizes(), digests.options().device(at::kCPU).pinned_memory(true));
  host.copy_(digests);  // waits for the kernel (and the table's copy before it)
  const uint8_t* d = host.data_ptr<uint8_t>();
  for (size_t k = 0; k < members.size(); ++k) {
    if (contiguous[k]->numel() == 0) continue;
    for (int64_t c = chunks->first[members[k]]; c < chunks->first[members[k] + 1]; ++c, d += 32) {
      std::copy(d, d + 32, chunks->digest[c].begin());
    }
  }
}
#endif

// The digest of tensors [begin, end): every tensor's dtype, shape and chunk digests, gathered
// into one buffer and hashed in one update (the same bytes as one update per field), in hex.
std::string GroupDigest(const std::vector<const at::Tensor*>& tensors, const ChunkList& chunks, size_t begin,
                        size_t end) {
  std::string bytes;
  bytes.reserve(static_cast<size_t>(chunks.first[end] - chunks.first[begin]) * 32 + (end - begin) * 40);
  for (size_t i = begin; i < end; ++i) {
    const at::Tensor& t = *tensors[i];
    bytes += c10::toString(t.scalar_type());
    for (int64_t d : t.sizes()) bytes.append(reinterpret_cast<const char*>(&d), sizeof(d));
    for (int64_t c = chunks.first[i]; c < chunks.first[i + 1]; ++c) {
      bytes.append(reinterpret_cast<const char*>(chunks.digest[c].data()), chunks.digest[c].size());
    }
  }
  Hasher top;
  top.Update(bytes.data(), bytes.size());
  const Sha256 digest = top.Final();
  std::string hex;
  char buf[3];
  for (unsigned char b : digest) {
    std::snprintf(buf, sizeof(buf), "%02x", b);
    hex += buf;
  }
  return hex;
}

// Below this many chunks in all, threads cost more than they save.
constexpr int64_t kParallelChunks = 256;

}  // namespace

std::string TensorsSha256(const std::vector<at::Tensor>& tensors) { return TensorGroupsSha256({tensors}).front(); }

std::vector<std::string> TensorGroupsSha256(const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<const at::Tensor*> tensors;  // pointers: no reference count traffic per tensor
  std::vector<size_t> group_begin;
  for (const auto& group : groups) {
    group_begin.push_back(tensors.size());
    for (const at::Tensor& t : group) tensors.push_back(&t);
  }
  group_begin.push_back(tensors.size());
  ChunkList chunks = SplitIntoChunks(tensors);
  const int64_t chunk_count = chunks.first.back();
  std::vector<const unsigned char*> chunk_data(static_cast<size_t>(chunk_count), nullptr);  // host bytes to hash here
  // Host tensors are hashed in place; device tensors on the device (CUDA kernels built), else
  // flattened per (device, dtype) into one page-locked host copy. A few (device, dtype) keys
  // at most: a flat list.
  std::vector<std::pair<std::tuple<at::DeviceType, int, at::ScalarType>, std::vector<size_t>>> on_device;
  std::vector<at::Tensor> host_bytes;  // keeps what chunk_data points into
  auto point_at = [&](size_t i, const at::Tensor& contiguous) {
    const auto* p = static_cast<const unsigned char*>(contiguous.data_ptr());
    for (int64_t c = chunks.first[i]; c < chunks.first[i + 1]; ++c) {
      chunk_data[c] = p;
      p += kChunkBytes;
    }
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = *tensors[i];
    if (t.is_cpu()) {
      if (t.is_contiguous()) {
        point_at(i, t);
      } else {
        host_bytes.push_back(t.detach().contiguous());
        point_at(i, host_bytes.back());
      }
      continue;
    }
    const std::tuple<at::DeviceType, int, at::ScalarType> key{t.device().type(), t.device().index(), t.scalar_type()};
    auto it = std::find_if(on_device.begin(), on_device.end(), [&](const auto& e) { return e.first == key; });
    if (it == on_device.end()) it = on_device.insert(on_device.end(), {key, {}});
    it->second.push_back(i);
  }
  for (const auto& [key, members] : on_device) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
    if (std::get<0>(key) == at::kCUDA) {
      HashOnDevice(tensors, members, &chunks);
      continue;
    }
#endif
    std::vector<at::Tensor> flat;
    for (size_t i : members) flat.push_back(tensors[i]->detach().reshape({-1}));
    const at::Tensor joined = at::cat(flat);
    // Page-locked host memory: a pageable device-to-host copy runs at a fraction of the link's speed.
    at::Tensor host = at::empty(joined.sizes(), joined.options().device(at::kCPU).pinned_memory(joined.is_cuda()));
    host.copy_(joined);
    host_bytes.push_back(host);
    int64_t offset = 0;
    for (size_t i : members) {
      point_at(i, host.narrow(0, offset, tensors[i]->numel()));
      offset += tensors[i]->numel();
    }
  }
  // Host bytes are hashed by a pool of threads.
  std::vector<std::pair<size_t, int64_t>> work;  // (tensor, chunk)
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (int64_t c = chunks.first[i]; c < chunks.first[i + 1]; ++c) {
      if (chunk_data[c] != nullptr) work.emplace_back(i, c);
    }
  }
  ForEachOnThreads(work.size(), /*parallel=*/true, [&](size_t k) {
    const auto [i, c] = work[k];
    Hasher h;
    h.Update(chunk_data[c], static_cast<size_t>(chunks.Size(tensors, c, i)));
    chunks.digest[c] = h.Final();
  });
  // Each group's digest; groups hashed side by side where there are many chunks.
  std::vector<std::string> out(groups.size());
  ForEachOnThreads(groups.size(), chunk_count >= kParallelChunks, [&](size_t g) {
    out[g] = GroupDigest(tensors, chunks, group_begin[g], group_begin[g + 1]);
  });
  return out;
}

}  // namespace lorastep
