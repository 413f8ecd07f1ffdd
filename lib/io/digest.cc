#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>
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
// dtype, shape and chunk digests in order.
struct Chunk {
  const unsigned char* data;
  int64_t size;
  Sha256 digest;
};

#ifdef LORASTEP_WITH_CUDA_KERNELS
// Fills the digests of `members`' chunks (tensors flattened back to back into `joined`, in
// order) on the device: only 32 bytes per chunk come back.
void HashOnDevice(const at::Tensor& joined, const std::vector<size_t>& members, std::vector<std::vector<Chunk>>* chunks) {
  std::vector<int64_t> offsets, sizes;
  int64_t start = 0;
  for (size_t i : members) {
    for (const Chunk& c : (*chunks)[i]) {
      offsets.push_back(start);
      sizes.push_back(c.size);
      start += c.size;
    }
  }
  const int64_t count = static_cast<int64_t>(offsets.size());
  if (count == 0) return;
  offsets.insert(offsets.end(), sizes.begin(), sizes.end());
  const at::Tensor table = at::tensor(offsets, at::kLong).to(joined.device());
  const at::Tensor digests = at::empty({count, 32}, joined.options().dtype(at::kByte));
  kernels::KernelLaunch launch(joined);
  kernels::CheckLaunch(kernels::LaunchRangeSha256(static_cast<const uint8_t*>(joined.data_ptr()),
                                                  table.data_ptr<int64_t>(), table.data_ptr<int64_t>() + count,
                                                  count, digests.data_ptr<uint8_t>(), launch.stream),
                       "sha256");
  const at::Tensor host = digests.to(at::kCPU);
  const uint8_t* d = host.data_ptr<uint8_t>();
  for (size_t i : members) {
    for (Chunk& c : (*chunks)[i]) {
      std::copy(d, d + 32, c.digest.begin());
      d += 32;
    }
  }
}
#endif

}  // namespace

std::string TensorsSha256(const std::vector<at::Tensor>& tensors) { return TensorGroupsSha256({tensors}).front(); }

std::vector<std::string> TensorGroupsSha256(const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<at::Tensor> tensors;
  for (const auto& group : groups) tensors.insert(tensors.end(), group.begin(), group.end());
  // Device tensors are flattened and concatenated per (device, dtype) first, so hundreds of
  // small adapter tensors cost one kernel (CUDA kernels built) or one copy to the host.
  std::vector<std::vector<Chunk>> chunks(tensors.size());  // sizes now; bytes or digests below
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].numel() * tensors[i].element_size();
    for (int64_t off = 0; off < bytes; off += kChunkBytes) chunks[i].push_back({nullptr, std::min(kChunkBytes, bytes - off), {}});
  }
  std::vector<bool> hashed(tensors.size(), false);  // digests came from the device
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
#ifdef LORASTEP_WITH_CUDA_KERNELS
    if (joined.is_cuda()) {
      HashOnDevice(joined, members, &chunks);
      for (size_t i : members) hashed[i] = true;
      continue;
    }
#endif
    // Page-locked host memory: a pageable device-to-host copy runs at a fraction of the link's speed.
    at::Tensor host = at::empty(joined.sizes(), joined.options().device(at::kCPU).pinned_memory(joined.is_cuda()));
    host.copy_(joined);
    int64_t offset = 0;
    for (size_t i : members) {
      cpu[i] = host.narrow(0, offset, tensors[i].numel()).view(tensors[i].sizes());
      offset += tensors[i].numel();
    }
  }
  // Host bytes are hashed by a pool of threads.
  std::vector<Chunk*> work;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (hashed[i]) continue;
    const auto* p = static_cast<const unsigned char*>(cpu[i].data_ptr());
    for (Chunk& c : chunks[i]) {
      c.data = p;
      p += c.size;
      work.push_back(&c);
    }
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
  std::vector<std::string> out;
  size_t i = 0;
  for (const auto& group : groups) {
    Hasher top;
    for (size_t end = i + group.size(); i < end; ++i) {
      const std::string dtype = c10::toString(tensors[i].scalar_type());
      top.Update(dtype.data(), dtype.size());
      for (int64_t d : tensors[i].sizes()) top.Update(&d, sizeof(d));
      for (const Chunk& c : chunks[i]) top.Update(c.digest.data(), c.digest.size());
    }
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
