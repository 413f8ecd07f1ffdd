#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <memory>
#include <thread>

namespace lorastep {
namespace {

// The unit of parallel hashing: 1 MiB, so a 35 MB adapter spreads over all threads. With
// 8 MiB chunks (5 of them) the digest took 5.2 ms of a 0.236 s LoRA step on the H200.
constexpr int64_t kChunkBytes = int64_t{1} << 20;

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
  // Device tensors reach the host in one copy per (device, dtype): flattened and
  // concatenated there first, so hundreds of small adapter tensors cost one transfer.
  std::vector<at::Tensor> cpu(tensors.size());
  std::map<std::pair<std::string, at::ScalarType>, std::vector<size_t>> on_device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].is_cpu()) {
      cpu[i] = tensors[i].detach().contiguous();
    } else {
      on_device[{tensors[i].device().str(), tensors[i].scalar_type()}].push_back(i);
    }
  }
  for (const auto& [key, members] : on_device) {
    std::vector<at::Tensor> flat;
    for (size_t i : members) flat.push_back(tensors[i].detach().reshape({-1}));
    at::Tensor joined = at::cat(flat);
    // Page-locked host memory: a pageable copy of a 35 MB adapter ran at ~1.4 GB/s.
    at::Tensor host = at::empty(joined.sizes(), joined.options().device(at::kCPU).pinned_memory(joined.is_cuda()));
    host.copy_(joined);
    int64_t offset = 0;
    for (size_t i : members) {
      cpu[i] = host.narrow(0, offset, tensors[i].numel()).view(tensors[i].sizes());
      offset += tensors[i].numel();
    }
  }
  // Every tensor's bytes in chunks of at most 8 MiB, hashed by a pool of threads; the result
  // hashes each tensor's dtype, shape and chunk digests in order.
  struct Chunk {
    const unsigned char* data;
    int64_t size;
    Sha256 digest;
  };
  std::vector<std::vector<Chunk>> chunks(cpu.size());
  std::vector<Chunk*> work;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const int64_t bytes = cpu[i].numel() * cpu[i].element_size();
    const auto* p = static_cast<const unsigned char*>(cpu[i].data_ptr());
    for (int64_t off = 0; off < bytes; off += kChunkBytes) chunks[i].push_back({p + off, std::min(kChunkBytes, bytes - off), {}});
  }
  for (auto& list : chunks) {
    for (auto& c : list) work.push_back(&c);
  }
  const size_t threads = std::min<size_t>(work.size(), std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t k = t; k < work.size(); k += threads) {
        Hasher h;
        h.Update(work[k]->data, work[k]->size);
        work[k]->digest = h.Final();
      }
    });
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
