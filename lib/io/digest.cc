#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace lorastep {
namespace {

// The unit of parallel hashing: 1 MiB, so a 35 MB adapter spreads over all threads. With
// 8 MiB chunks (5 of them) the digest took 5.2 ms of a 0.236 s LoRA step on the H200.
constexpr int64_t kChunkBytes = int64_t{1} << 20;
// Device-to-host copies go in pieces of this size, hashed as they arrive.
constexpr int64_t kPieceBytes = int64_t{4} << 20;

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

}  // namespace

std::string TensorsSha256(const std::vector<at::Tensor>& tensors) {
  // Device tensors reach the host in one pinned buffer per (device, dtype), flattened and
  // concatenated there first, so hundreds of small adapter tensors cost one transfer. The
  // buffer is copied in pieces while the pool already hashes the pieces that arrived.
  struct HostBuffer {
    at::Tensor device, host;
    std::atomic<int64_t> arrived{0};  // bytes of `host` copied so far
  };
  std::vector<at::Tensor> cpu(tensors.size());
  std::vector<const HostBuffer*> source(tensors.size(), nullptr);
  std::vector<int64_t> source_offset(tensors.size(), 0);  // bytes into the buffer
  std::map<std::pair<std::string, at::ScalarType>, std::vector<size_t>> on_device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].is_cpu()) {
      cpu[i] = tensors[i].detach().contiguous();
    } else {
      on_device[{tensors[i].device().str(), tensors[i].scalar_type()}].push_back(i);
    }
  }
  std::vector<std::unique_ptr<HostBuffer>> buffers;
  for (const auto& [key, members] : on_device) {
    std::vector<at::Tensor> flat;
    for (size_t i : members) flat.push_back(tensors[i].detach().reshape({-1}));
    auto buffer = std::make_unique<HostBuffer>();
    buffer->device = at::cat(flat);
    // Page-locked host memory: a pageable copy of a 35 MB adapter ran at ~1.4 GB/s.
    buffer->host = at::empty(buffer->device.sizes(),
                             buffer->device.options().device(at::kCPU).pinned_memory(buffer->device.is_cuda()));
    int64_t offset = 0;
    for (size_t i : members) {
      cpu[i] = buffer->host.narrow(0, offset, tensors[i].numel()).view(tensors[i].sizes());
      source[i] = buffer.get();
      source_offset[i] = offset * buffer->host.element_size();
      offset += tensors[i].numel();
    }
    buffers.push_back(std::move(buffer));
  }
  // Every tensor's bytes in chunks of at most kChunkBytes, hashed by a pool of threads; the
  // result hashes each tensor's dtype, shape and chunk digests in order.
  struct Chunk {
    const unsigned char* data;
    int64_t size;
    const HostBuffer* source;  // null: already on the host
    int64_t end;               // bytes of `source` that must have arrived
    Sha256 digest;
  };
  std::vector<std::vector<Chunk>> chunks(cpu.size());
  std::vector<Chunk*> work;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const int64_t bytes = cpu[i].numel() * cpu[i].element_size();
    const auto* p = static_cast<const unsigned char*>(cpu[i].data_ptr());
    for (int64_t off = 0; off < bytes; off += kChunkBytes) {
      const int64_t size = std::min(kChunkBytes, bytes - off);
      chunks[i].push_back({p + off, size, source[i], source_offset[i] + off + size, {}});
    }
  }
  for (auto& list : chunks) {
    for (auto& c : list) work.push_back(&c);
  }
  std::mutex mu;
  std::condition_variable arrived;
  const size_t threads = std::min<size_t>(work.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t k = t; k < work.size(); k += threads) {
        if (const HostBuffer* from = work[k]->source) {
          std::unique_lock<std::mutex> lock(mu);
          arrived.wait(lock, [&] { return from->arrived.load() >= work[k]->end; });
        }
        Hasher h;
        h.Update(work[k]->data, work[k]->size);
        work[k]->digest = h.Final();
      }
    });
  }
  auto release = [&](HostBuffer& buffer, int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      buffer.arrived = bytes;
    }
    arrived.notify_all();
  };
  try {
    for (auto& buffer : buffers) {
      const int64_t numel = buffer->host.numel(), per_piece = std::max<int64_t>(1, kPieceBytes / buffer->host.element_size());
      for (int64_t start = 0; start < numel; start += per_piece) {
        const int64_t n = std::min(per_piece, numel - start);
        buffer->host.narrow(0, start, n).copy_(buffer->device.narrow(0, start, n));
        release(*buffer, (start + n) * buffer->host.element_size());
      }
    }
  } catch (...) {  // a failed copy: let the pool finish (hashing garbage), then report
    for (auto& buffer : buffers) release(*buffer, std::numeric_limits<int64_t>::max());
    for (auto& th : pool) th.join();
    throw;
  }
  for (auto& th : pool) th.join();
  Hasher top;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::string dtype = c10::toString(cpu[i].scalar_type());
    top.Update(dtype.data(), dtype.size());
    for (int64_t d : cpu[i].sizes()) top.Update(&d, sizeof(d));
    for (const Chunk& c : chunks[i]) top.Update(c.digest.data(), c.digest.size());
  }
  const Sha256 out = top.Final();
  std::string hex;
  char buf[3];
  for (unsigned char b : out) {
    std::snprintf(buf, sizeof(buf), "%02x", b);
    hex += buf;
  }
  return hex;
}

}  // namespace lorastep
