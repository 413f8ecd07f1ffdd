#include "lib/device_stats.h"

#include <ATen/Functions.h>

#include <algorithm>

#ifdef LORASTEP_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>
#endif

namespace lorastep {

#ifdef LORASTEP_WITH_CUDA

int64_t CudaPeakAllocatedBytes(const c10::Device& device) {
  if (!device.is_cuda()) return -1;
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  // Index 0 of each stat array is the aggregate over pool kinds in every torch version.
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).allocated_bytes[0].peak;
}

void ResetCudaPeakAllocated(const c10::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
}

int64_t CudaAvailableBytes(const c10::Device& device) {
  if (!device.is_cuda()) return -1;
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  const c10::cuda::CUDAGuard guard(index);
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) return -1;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const int64_t cached_unused = stats.reserved_bytes[0].current - stats.allocated_bytes[0].current;
  return static_cast<int64_t>(free) + std::max<int64_t>(0, cached_unused);
}

std::string CudaDeviceName(const c10::Device& device) {
  if (!device.is_cuda()) return "";
  cudaDeviceProp properties;
  if (cudaGetDeviceProperties(&properties, device.has_index() ? device.index() : 0) != cudaSuccess) return "";
  return properties.name;
}

absl::Status StartKernelProfile() {
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  return absl::OkStatus();
}

absl::Status StopKernelProfile(const std::string& trace_path) {
  auto result = torch::autograd::profiler::disableProfiler();
  if (result == nullptr) return absl::FailedPreconditionError("no profile was running");
  result->save(trace_path);
  return absl::OkStatus();
}

DeviceMark DeviceMark::Now(const c10::Device& device) {
  DeviceMark mark;
  mark.host_ = std::chrono::steady_clock::now();
  if (device.is_cuda()) {
    auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
    event->record(c10::cuda::getCurrentCUDAStream(device.has_index() ? device.index() : 0));
    mark.event_ = event;
  }
  return mark;
}

double DeviceMark::SecondsSince(const DeviceMark& earlier) const {
  if (event_ != nullptr && earlier.event_ != nullptr) {
    auto* end = static_cast<at::cuda::CUDAEvent*>(event_.get());
    end->synchronize();
    return static_cast<at::cuda::CUDAEvent*>(earlier.event_.get())->elapsed_time(*end) / 1000.0;
  }
  return std::chrono::duration<double>(host_ - earlier.host_).count();
}

DeferredHostCopy DeferredHostCopy::Start(at::Tensor tensor) {
  DeferredHostCopy copy;
  if (tensor.is_cuda()) {
    auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
    event->record(c10::cuda::getCurrentCUDAStream(tensor.device().index()));
    copy.event_ = event;
  }
  copy.tensor_ = std::move(tensor);
  return copy;
}

at::Tensor DeferredHostCopy::Finish() const {
  if (event_ == nullptr) return tensor_;
  const c10::DeviceIndex index = tensor_.device().index();
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  c10::cuda::CUDAStreamGuard on_side(side);
  static_cast<at::cuda::CUDAEvent*>(event_.get())->block(side);
  at::Tensor host = at::empty(tensor_.sizes(), tensor_.options().device(at::kCPU).pinned_memory(true));
  host.copy_(tensor_, /*non_blocking=*/true);
  side.synchronize();  // before the device tensor can be freed (its block is the main stream's)
  return host;
}

#else

DeferredHostCopy DeferredHostCopy::Start(at::Tensor tensor) {
  DeferredHostCopy copy;
  copy.tensor_ = std::move(tensor);
  return copy;
}

at::Tensor DeferredHostCopy::Finish() const { return tensor_; }

DeviceMark DeviceMark::Now(const c10::Device&) {
  DeviceMark mark;
  mark.host_ = std::chrono::steady_clock::now();
  return mark;
}

double DeviceMark::SecondsSince(const DeviceMark& earlier) const {
  return std::chrono::duration<double>(host_ - earlier.host_).count();
}

int64_t CudaPeakAllocatedBytes(const c10::Device&) { return -1; }
int64_t CudaAvailableBytes(const c10::Device&) { return -1; }
std::string CudaDeviceName(const c10::Device&) { return ""; }
void ResetCudaPeakAllocated(const c10::Device&) {}
absl::Status StartKernelProfile() {
  return absl::UnimplementedError("kernel profiles need the CUDA build");
}
absl::Status StopKernelProfile(const std::string&) {
  return absl::UnimplementedError("kernel profiles need the CUDA build");
}

#endif

}  // namespace lorastep
