#include "lib/io/digest.h"

#include <openssl/evp.h>

#include <cstdio>
#include <memory>

namespace lorastep {

std::string TensorsSha256(const std::vector<at::Tensor>& tensors) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  for (const at::Tensor& t : tensors) {
    at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
    const std::string dtype = c10::toString(cpu.scalar_type());
    EVP_DigestUpdate(ctx.get(), dtype.data(), dtype.size());
    for (int64_t d : cpu.sizes()) EVP_DigestUpdate(ctx.get(), &d, sizeof(d));
    EVP_DigestUpdate(ctx.get(), cpu.data_ptr(), cpu.numel() * cpu.element_size());
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), out, &len);
  std::string hex;
  char buf[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", out[i]);
    hex += buf;
  }
  return hex;
}

}  // namespace lorastep
