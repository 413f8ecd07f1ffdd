#include "lib/grad_finalizer.h"
#include <ATen/core/grad_mode.h>

#include "lib/torch_status.h"

namespace lorastep {

absl::Status FinalizeGradients(Adapter* adapter) {
  return GuardTorch([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    for (Parameter& p : adapter->parameters()) {
      at::Tensor& grad = p.value.mutable_grad();
      if (!grad.defined()) continue;
      p.main_grad.add_(grad.to(at::kFloat));
      grad = at::Tensor();  // moved into main_grad: never added twice
    }
    return absl::OkStatus();
  });
}

}  // namespace lorastep
