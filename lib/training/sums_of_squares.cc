#include "lib/training/sums_of_squares.h"

#include <algorithm>
#include <optional>

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/kernel_launch.h"
#include "lib/kernels/sum_squares.h"
#endif

namespace lorastep {
namespace {

#ifdef LORASTEP_WITH_CUDA_KERNELS
// The CUDA device every defined term lies on, where each is contiguous fp32; else nullopt.
std::optional<at::Device> KernelDevice(const std::vector<std::vector<SquareTerm>>& groups) {
  std::optional<at::Device> device;
  for (const auto& group : groups) {
    for (const SquareTerm& t : group) {
      if (!t.values.defined()) continue;
      if (!t.values.is_cuda() || t.values.scalar_type() != at::kFloat || !t.values.is_contiguous() ||
          (device.has_value() && t.values.device() != *device)) {
        return std::nullopt;
      }
      device = t.values.device();
    }
  }
  return device;
}

// Every term cut into chunks of kSquareChunkElements; the chunk table and each group's end go
// to the device in one copy.
at::Tensor OnDevice(const std::vector<std::vector<SquareTerm>>& groups, const at::Device& device) {
  constexpr int64_t kStep = kernels::kSquareChunkElements;
  int64_t chunks = 0;
  for (const auto& group : groups) {
    for (const SquareTerm& t : group) chunks += t.values.defined() ? (t.values.numel() + kStep - 1) / kStep : 0;
  }
  const auto count = static_cast<int64_t>(groups.size());
  const at::Tensor host = kernels::HostTable(3 * chunks + count);  // the chunks, then the groups' ends
  int64_t* e = host.data_ptr<int64_t>();
  int64_t* ends = e + 3 * chunks;
  for (const auto& group : groups) {
    for (const SquareTerm& t : group) {
      if (!t.values.defined()) continue;
      const auto base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.values.data_ptr<float>()));
      const int64_t n = t.values.numel();
      for (int64_t at = 0; at < n; at += kStep) {
        *e++ = base + at * static_cast<int64_t>(sizeof(float));
        *e++ = std::min(kStep, n - at);
        *e++ = t.negative ? 1 : 0;
      }
    }
    *ends++ = (e - host.data_ptr<int64_t>()) / 3;
  }
  const at::Tensor meta = host.to(device, /*non_blocking=*/true);
  const at::Tensor scratch = at::empty({chunks + count}, at::TensorOptions().dtype(at::kDouble).device(device));
  kernels::KernelLaunch launch(scratch);
  const int64_t* m = meta.data_ptr<int64_t>();
  double* s = scratch.data_ptr<double>();
  kernels::CheckLaunch(
      kernels::LaunchGroupSumsOfSquares(m, chunks, m + 3 * chunks, count, s, s + chunks, launch.stream),
      "sums of squares");
  return scratch.narrow(0, chunks, count);
}
#endif

}  // namespace

at::Tensor GroupSumsOfSquares(const std::vector<std::vector<SquareTerm>>& groups, const at::Device& device) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (std::optional<at::Device> on = KernelDevice(groups)) return OnDevice(groups, *on);
#endif
  std::vector<at::Tensor> sums;
  for (const auto& group : groups) {
    at::Tensor sq = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
    for (const SquareTerm& t : group) {
      if (!t.values.defined()) continue;
      const at::Tensor term = t.values.to(at::kDouble).pow(2).sum();  // fp64: small terms are not lost
      sq = t.negative ? sq - term : sq + term;
    }
    sums.push_back(sq);
  }
  return sums.empty() ? at::zeros({0}, at::TensorOptions().dtype(at::kDouble).device(device)) : at::stack(sums);
}

}  // namespace lorastep
