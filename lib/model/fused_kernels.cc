#include "lib/model/fused_kernels.h"

#include "lib/env_switch.h"

namespace lorastep {

bool UseFusedKernels(const at::Tensor& x, const at::Tensor& other) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  static const bool enabled = EnvSwitchOn("LORASTEP_FUSED_KERNELS");
  return enabled && x.is_cuda() && x.scalar_type() == other.scalar_type() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat);
#else
  (void)x, (void)other;
  return false;
#endif
}

}  // namespace lorastep
