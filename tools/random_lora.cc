#include "tools/random_lora.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace lorastep {

void DrawLoraFactors(Adapter& adapter, uint64_t seed, double scale) {
  at::NoGradGuard no_grad;
  at::manual_seed(seed);
  for (Parameter& p : adapter.parameters()) p.value.copy_(at::randn_like(p.value) * scale);
}

}  // namespace lorastep
