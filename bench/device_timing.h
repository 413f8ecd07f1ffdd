// Timing device work from the host for the microbenchmarks: the median of `reps` timings of
// `inner` back-to-back calls, the device synchronized around each timing (a CUDA device's
// queue drained by reading a value back).
#ifndef LORASTEP_BENCH_DEVICE_TIMING_H_
#define LORASTEP_BENCH_DEVICE_TIMING_H_

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace lorastep {

inline void SyncDevice(const at::Device& device) {
  if (device.is_cuda()) at::zeros({1}, at::TensorOptions().device(device)).item<float>();
}

// Milliseconds per call; `warmup` calls first (handles, workspaces, the allocator).
inline double DeviceMedianMs(const at::Device& device, int reps, int inner, const std::function<void()>& fn,
                             int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    SyncDevice(device);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < inner; ++i) fn();
    SyncDevice(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / inner);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_DEVICE_TIMING_H_
