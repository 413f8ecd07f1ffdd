#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <tuple>
#include <map>
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
  std::vector<int64_t> size;   // per chunk
  std::vector<Sha256> digest;  // per chunk
};

ChunkList SplitIntoChunks(const std::vector<at::Tensor>& tensors) {
  ChunkList chunks;
  chunks.first.reserve(tensors.size() + 1);
  for (const at::Tensor& t : tensors) {
    chunks.first.push_back(static_cast<int64_t>(chunks.size.size()));
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    for (int64_t off = 0; off < bytes; off += kChunkBytes) chunks.size.push_back(std::min(kChunkBytes, bytes - off));
  }
  chunks.first.push_back(static_cast<int64_t>(chunks.size.size()));
  chunks.digest.resize(chunks.size.size());
  return chunks;
}

#ifdef LORASTEP_WITH_CUDA_KERNELS
// Fills the chunk digests of the device tensors `members` on the device, reading each tensor
// where it lies (no copy of the bytes): one kernel over every member's chunks, whatever
// buffers they are in (several runs' adapters after a joint step fill the GPU together);
// only 32 bytes per chunk come back, with one wait for all of them.
void HashOnDevice(const std::vector<at::Tensor>& tensors, const std::vector<size_t>& members, ChunkList* chunks) {
  std::vector<int64_t> starts, sizes, chunk_ids;
  std::deque<at::Tensor> kept;  // contiguous copies of strided members (alive until the wait)
  for (size_t i : members) {
    // No per-tensor detach or view: for over a thousand tensors a run, making them costs more
    // than hashing their bytes.
    const at::Tensor* t = &tensors[i];
    if (t->numel() == 0) continue;
    if (!t->is_contiguous()) {
      kept.push_back(t->detach().contiguous());
      t = &kept.back();
    }
    auto at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data_ptr()));
    for (int64_t c = chunks->first[i]; c < chunks->first[i + 1]; ++c) {
      starts.push_back(at);
      sizes.push_back(chunks->size[c]);
      chunk_ids.push_back(c);
      at += chunks->size[c];
    }
  }
  if (starts.empty()) return;
  const auto count = static_cast<int64_t>(starts.size());
  starts.insert(starts.end(), sizes.begin(), sizes.end());  // one table: starts, then sizes
  const at::Tensor& any = tensors[members.front()];
  const at::Tensor table = at::tensor(starts, at::kLong).to(any.device());
  const at::Tensor digests = at::empty({count, 32}, any.options().dtype(at::kByte));
  kernels::KernelLaunch launch(any);
  const int64_t* on_device = table.data_ptr<int64_t>();
  kernels::CheckLaunch(kernels::LaunchRangeSha256(on_device, on_device + count, count, digests.data_ptr<uint8_t>(),
                                                  launch.stream),
                       "sha256");
  const at::Tensor host = digests.to(at::kCPU);
  const uint8_t* d = host.data_ptr<uint8_t>();
  for (int64_t c : chunk_ids) {
    std::copy(d, d + 32, chunks->digest[c].begin());
    d += 32;
  }
}
#endif

}  // namespace

std::string TensorsSha256(const std::vector<at::Tensor>& tensors) { return TensorGroupsSha256({tensors}).front(); }

std::vector<std::string> TensorGroupsSha256(const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<at::Tensor> tensors;
  for (const auto& group : groups) tensors.insert(tensors.end(), group.begin(), group.end());
  ChunkList chunks = SplitIntoChunks(tensors);
  std::vector<const unsigned char*> chunk_data(chunks.size.size(), nullptr);  // host bytes to hash here
  // Host tensors are hashed in place; device tensors on the device (CUDA kernels built), else
  // flattened per (device, dtype) into one page-locked host copy.
  std::map<std::tuple<int, int, at::ScalarType>, std::vector<size_t>> on_device;  // (device type, index, dtype)
  std::vector<at::Tensor> host_bytes;  // keeps what chunk_data points into
  auto point_at = [&](size_t i, const at::Tensor& contiguous) {
    const auto* p = static_cast<const unsigned char*>(contiguous.data_ptr());
    for (int64_t c = chunks.first[i]; c < chunks.first[i + 1]; ++c) {
      chunk_data[c] = p;
      p += chunks.size[c];
    }
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].is_cpu()) {
      if (tensors[i].is_contiguous()) {
        point_at(i, tensors[i]);
      } else {
        host_bytes.push_back(tensors[i].detach().contiguous());
        point_at(i, host_bytes.back());
      }
    } else {
      const at::Device device = tensors[i].device();
      on_device[{static_cast<int>(device.type()), static_cast<int>(device.index()), tensors[i].scalar_type()}].push_back(i);
    }
  }
  for (const auto& [key, members] : on_device) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
    if (tensors[members.front()].is_cuda()) {
      HashOnDevice(tensors, members, &chunks);
      continue;
    }
#endif
    std::vector<at::Tensor> flat;
    for (size_t i : members) flat.push_back(tensors[i].detach().reshape({-1}));
    const at::Tensor joined = at::cat(flat);
    // Page-locked host memory: a pageable device-to-host copy runs at a fraction of the link's speed.
    at::Tensor host = at::empty(joined.sizes(), joined.options().device(at::kCPU).pinned_memory(joined.is_cuda()));
    host.copy_(joined);
    host_bytes.push_back(host);
    int64_t offset = 0;
    for (size_t i : members) {
      point_at(i, host.narrow(0, offset, tensors[i].numel()));
      offset += tensors[i].numel();
    }
  }
  // Host bytes are hashed by a pool of threads.
  std::vector<int64_t> work;
  for (size_t c = 0; c < chunk_data.size(); ++c) {
    if (chunk_data[c] != nullptr) work.push_back(static_cast<int64_t>(c));
  }
  const size_t threads = std::min<size_t>(work.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t k = t; k < work.size(); k += threads) {
        Hasher h;
        h.Update(chunk_data[work[k]], static_cast<size_t>(chunks.size[work[k]]));
        chunks.digest[work[k]] = h.Final();
      }
    });
  }
  for (auto& th : pool) th.join();
  // Each group's digest: every tensor's dtype, shape and chunk digests, gathered into one
  // buffer and hashed in one update (the same bytes as one update per field).
  std::vector<std::string> out;
  size_t i = 0;
  std::string bytes;
  for (const auto& group : groups) {
    bytes.clear();
    for (size_t end = i + group.size(); i < end; ++i) {
      bytes += c10::toString(tensors[i].scalar_type());
      for (int64_t d : tensors[i].sizes()) bytes.append(reinterpret_cast<const char*>(&d), sizeof(d));
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
    out.push_back(std::move(hex));
  }
  return out;
}

}  // namespace lorastep
