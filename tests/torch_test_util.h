// Helpers for tests that use LibTorch: the device under test (LORASTEP_TEST_DEVICE, default
// cpu), a tiny generated model on disk, and tensor comparisons.
#ifndef LORASTEP_TESTS_TORCH_TEST_UTIL_H_
#define LORASTEP_TESTS_TORCH_TEST_UTIL_H_

#include <ATen/ATen.h>

#include <cstdlib>
#include <string>

#include "lib/model_config.h"
#include "lib/model_weights.h"

namespace lorastep {
namespace testing {

inline at::Device TestDevice() {
  const char* d = std::getenv("LORASTEP_TEST_DEVICE");
  return at::Device(d != nullptr ? d : "cpu");
}

// Relative error ||a - b|| / ||b|| in fp64.
inline double RelErr(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
  return ((x - y).norm() / y.norm().clamp_min(1e-30)).item<double>();
}

inline double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.detach().to(at::kCPU, at::kDouble), y = b.detach().to(at::kCPU, at::kDouble);
  return (x - y).abs().max().item<double>();
}

}  // namespace testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_TORCH_TEST_UTIL_H_
