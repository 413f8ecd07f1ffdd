// Helpers for tests that use LibTorch: the device under test (LORASTEP_TEST_DEVICE, default
// cpu), a tiny generated model on disk, and tensor comparisons.
#ifndef LORASTEP_TESTS_TORCH_TEST_UTIL_H_
#define LORASTEP_TESTS_TORCH_TEST_UTIL_H_

#include <ATen/ATen.h>

#include <cstdlib>
#include <string>

#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"

namespace lorastep {
namespace testing {

inline at::Device TestDevice() {
  const char* d = std::getenv("LORASTEP_TEST_DEVICE");
  return at::Device(d != nullptr ? d : "cpu");
}

// The dtype under test (LORASTEP_TEST_DTYPE: float32 default, bfloat16 on the GPU run).
inline at::ScalarType TestDtype() {
  const char* d = std::getenv("LORASTEP_TEST_DTYPE");
  return d != nullptr && std::string(d) == "bfloat16" ? at::kBFloat16 : at::kFloat;
}
inline std::string TestDtypeName() { return TestDtype() == at::kBFloat16 ? "bfloat16" : "float32"; }

// A tolerance stated for fp32, widened for bf16 (8 mantissa bits: rel ~4e-3 per rounding,
// a few roundings deep).
inline double Tol(double fp32_tolerance) {
  return TestDtype() == at::kBFloat16 ? 3e-2 : fp32_tolerance;
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
