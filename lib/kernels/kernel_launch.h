// How C++ code hands ATen tensors to lorastep's CUDA kernels (CUDA build only).
#ifndef LORASTEP_LIB_KERNELS_KERNEL_LAUNCH_H_
#define LORASTEP_LIB_KERNELS_KERNEL_LAUNCH_H_

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

inline ElementType ElementTypeOf(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "lorastep kernels: unsupported dtype ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? ElementType::kBFloat16
         : t.scalar_type() == at::kHalf   ? ElementType::kFloat16
                                          : ElementType::kFloat32;
}

// A raw kernel launch goes to the current device: make it the tensor's device and use that
// device's current stream. The worker's gRPC threads have cuda:0 current whatever cuda:N
// the rank holds; a launch there with cuda:1 pointers was an illegal memory access (DP2).
struct KernelLaunch {
  explicit KernelLaunch(const at::Tensor& on)
      : guard(on.device()), stream(c10::cuda::getCurrentCUDAStream(on.device().index()).stream()) {}
  c10::cuda::CUDAGuard guard;
  cudaStream_t stream;
};

// A table of `count` int64 fields that the host fills for a kernel: page-locked, so that its
// copy to the device (`.to(device, /*non_blocking=*/true)`) does not wait.
inline at::Tensor HostTable(int64_t count) {
  return at::empty({count}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
}

// Stops the caller (as a c10::Error, which the status layer maps) when a launch failed.
inline void CheckLaunch(const char* error, const char* what) {
  TORCH_CHECK(error == nullptr, what, " kernel: ", error);
}

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_KERNEL_LAUNCH_H_
