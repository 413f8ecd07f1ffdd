#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>
#include <thread>

namespace lorastep {
namespace {

constexpr int64_t kChunkBytes = int64_t{8} << 20;  // larger tensors are hashed in parallel chunks

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
  std::vector<at::Tensor> cpu;
  for (const at::Tensor& t : tensors) cpu.push_back(t.detach().to(at::kCPU).contiguous());
  // Chunks of every large tensor, hashed by a few threads; each tensor then contributes its
  // chunks' digests in order instead of its bytes (small tensors contribute their bytes).
  struct Chunk {
    const unsigned char* data;
    int64_t size;
    Sha256 digest;
  };
  std::vector<std::vector<Chunk>> chunks(cpu.size());
  std::vector<Chunk*> work;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const int64_t bytes = cpu[i].numel() * cpu[i].element_size();
    if (bytes <= kChunkBytes) continue;
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
    if (chunks[i].empty()) {
      top.Update(cpu[i].data_ptr(), cpu[i].numel() * cpu[i].element_size());
    } else {
      for (const Chunk& c : chunks[i]) top.Update(c.digest.data(), c.digest.size());
    }
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
