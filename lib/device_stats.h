// CUDA memory figures and a kernel-level profile, where the build has CUDA.
// The CPU build (Debian's LibTorch 1.13) compiles the same calls as no-ops, so callers need
// no #ifdef: memory figures are absent (-1) and a profile request is UNIMPLEMENTED.
#ifndef LORASTEP_LIB_DEVICE_STATS_H_
#define LORASTEP_LIB_DEVICE_STATS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace lorastep {

// Peak bytes held by tensors on `device` (the caching allocator's allocated-bytes peak)
// since the last reset; -1 for a CPU device or a build without CUDA.
int64_t CudaPeakAllocatedBytes(const c10::Device& device);
void ResetCudaPeakAllocated(const c10::Device& device);
// Bytes a new allocation on `device` can still get: the driver's free memory plus what the
// caching allocator holds unused; -1 for a CPU device or a build without CUDA.
int64_t CudaAvailableBytes(const c10::Device& device);
// The driver's name of a CUDA device ("NVIDIA H200"); "" for a CPU device or a build without CUDA.
std::string CudaDeviceName(const c10::Device& device);

// A Kineto trace (CPU operators and CUDA kernels) of everything run between Start and Stop,
// saved as a Chrome trace JSON (bench/profile_summary.py turns it into a per-kernel table).
absl::Status StartKernelProfile();
absl::Status StopKernelProfile(const std::string& trace_path);

// A point in the device's work queue, for timing phases without stopping the host: on CUDA
// an event recorded on the current stream (the host does not wait), elsewhere the host
// clock (CPU work is done when the call returns). A host synchronization per micro-batch
// starves the GPU while the host queues the next kernels.
class DeviceMark {
 public:
  static DeviceMark Now(const c10::Device& device);
  // Seconds from `earlier` to this mark; on CUDA waits until the device reaches this mark.
  double SecondsSince(const DeviceMark& earlier) const;

 private:
  std::shared_ptr<void> event_;  // a CUDA event (CUDA build, CUDA device), else null
  std::chrono::steady_clock::time_point host_;
};

// A copy of a device tensor into host memory that the caller fences now and makes later,
// from any thread, without stopping the device's other work: on CUDA, Start records an event
// after the work queued so far (the tensor's producers) and Finish copies on a side stream
// that waits for that event, into pinned memory. Start's caller must not change the tensor
// afterwards. On the CPU Finish returns the tensor itself.
class DeferredHostCopy {
 public:
  DeferredHostCopy() = default;
  static DeferredHostCopy Start(at::Tensor tensor);
  at::Tensor Finish() const;

 private:
  at::Tensor tensor_;
  std::shared_ptr<void> event_;  // a CUDA event (CUDA build, CUDA tensor), else null
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_DEVICE_STATS_H_
