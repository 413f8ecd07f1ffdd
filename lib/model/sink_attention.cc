#include "lib/model/sink_attention.h"

#include <array>
#include <string>

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include "lib/env_switch.h"
#include "lib/torch_compat.h"

namespace lorastep {
namespace {

// The kernel object through autograd's saved data, which holds IValues.
struct KernelCapsule : public torch::CustomClassHolder {
  explicit KernelCapsule(std::shared_ptr<LseAttentionKernel> k) : kernel(std::move(k)) {}
  std::shared_ptr<LseAttentionKernel> kernel;
};

class SinkThroughLseFunction : public torch::autograd::Function<SinkThroughLseFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& sinks,
                            const std::shared_ptr<LseAttentionKernel>& kernel) {
    const SinkAttentionSaved saved = SinkAttentionForward(q, k, v, sinks, kernel);
    ctx->save_for_backward({q, k, v, saved.out, saved.lse, saved.kept});
    ctx->saved_data["kernel"] = c10::IValue::make_capsule(c10::make_intrusive<KernelCapsule>(kernel));
    ctx->saved_data["sinks_grad"] = sinks.requires_grad();
    ctx->saved_data["sinks_dtype"] = static_cast<int64_t>(sinks.scalar_type());
    return saved.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto t = ctx->get_saved_variables();
    SinkAttentionSaved saved;
    saved.out = t[3], saved.lse = t[4], saved.kept = t[5];
    saved.kernel = c10::static_intrusive_pointer_cast<KernelCapsule>(ctx->saved_data["kernel"].toCapsule())->kernel;
    const bool sinks_grad = ctx->saved_data["sinks_grad"].toBool();
    auto [dq, dk, dv, dsinks] = SinkAttentionBackward(saved, grads[0], t[0], t[1], t[2], sinks_grad);
    if (sinks_grad) dsinks = dsinks.to(static_cast<at::ScalarType>(ctx->saved_data["sinks_dtype"].toInt()));
    return {dq, dk, dv, dsinks, at::Tensor()};
  }
};

class VarlenFlashKernel : public LseAttentionKernel {
 public:
  VarlenFlashKernel(at::Tensor cu_seqlens, int64_t max_length, int64_t window)
      : cu_seqlens_(std::move(cu_seqlens)), max_length_(max_length), window_(window) {}

  std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) override {
    saved_ = compat::VarlenCausalAttentionSaved(q, k, v, cu_seqlens_, max_length_, window_);
    at::Tensor o = std::move(saved_.out);  // backward gets the sink-scaled output instead
    const int64_t t = q.size(0);
    if (saved_.logsumexp.dim() == 2 && saved_.logsumexp.size(1) == t) return {o, saved_.logsumexp};
    // Builds whose varlen kernel pads its log-sum-exp per sequence: [count, heads, max_length].
    TORCH_CHECK(saved_.logsumexp.dim() == 3, "flash varlen log-sum-exp of unknown layout ",
                saved_.logsumexp.sizes());
    return {o, PaddedLseByToken(saved_.logsumexp, cu_seqlens_, t)};
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> Backward(const at::Tensor& grad, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& out, const at::Tensor& lse) override {
    (void)lse;  // the kernel's own layout of it is kept in saved_
    compat::VarlenAttentionSaved with_out = saved_;
    with_out.out = out;
    return compat::VarlenCausalAttentionBackward(grad, q, k, v, with_out, cu_seqlens_, max_length_);
  }

 private:
  at::Tensor cu_seqlens_;
  int64_t max_length_ = 0, window_ = 0;
  compat::VarlenAttentionSaved saved_;
};

}  // namespace

at::Tensor PaddedLseByToken(const at::Tensor& padded, const at::Tensor& cu_seqlens, int64_t total) {
  const at::Tensor token = at::arange(total, cu_seqlens.options().dtype(at::kLong));
  const at::Tensor starts = cu_seqlens.to(at::kLong);
  const at::Tensor sequence =
      at::searchsorted(starts.narrow(0, 1, starts.size(0) - 1), token, /*out_int32=*/false, /*right=*/true);
  const at::Tensor position = token - starts.index_select(0, sequence);
  return padded.permute({0, 2, 1}).index({sequence, position}).t().contiguous();  // [heads, total]
}

SinkAttentionSaved SinkAttentionForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& sinks, std::shared_ptr<LseAttentionKernel> kernel) {
  at::NoGradGuard no_grad;
  auto [o, lse] = kernel->Forward(q, k, v);
  const at::ScalarType wide = at::promote_types(q.scalar_type(), at::kFloat);
  SinkAttentionSaved saved;
  // [t, heads, 1]: the share of each softmax's mass that stays with the keys.
  saved.kept = at::sigmoid(lse.to(wide) - sinks.to(wide).view({-1, 1})).t().unsqueeze(-1);
  saved.out = (o.to(wide) * saved.kept).to(o.scalar_type());
  saved.lse = lse;
  saved.kernel = std::move(kernel);
  return saved;
}

std::array<at::Tensor, 4> SinkAttentionBackward(const SinkAttentionSaved& saved, const at::Tensor& grad,
                                                const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                bool sinks_grad) {
  at::NoGradGuard no_grad;
  const at::Tensor g = grad.to(saved.kept.scalar_type());
  auto [dq, dk, dv] = saved.kernel->Backward((g * saved.kept).to(q.scalar_type()), q, k, v, saved.out, saved.lse);
  at::Tensor dsinks;
  if (sinks_grad) {
    dsinks = -((1 - saved.kept) * (g * saved.out.to(g.scalar_type())).sum(-1, /*keepdim=*/true))
                  .sum(at::IntArrayRef{0, 2});
  }
  return {dq, dk, dv, dsinks};
}

at::Tensor SinkAttentionThroughLse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& sinks, std::shared_ptr<LseAttentionKernel> kernel) {
  return SinkThroughLseFunction::apply(q, k, v, sinks, kernel);
}

bool UseSinkFlash(const at::Tensor& q) {
  static const bool on = EnvSwitchOn("LORASTEP_SINK_FLASH");
  return on && compat::HasVarlenAttention(q);
}

std::shared_ptr<LseAttentionKernel> VarlenFlashLseKernel(at::Tensor cu_seqlens, int64_t max_length, int64_t window) {
  return std::make_shared<VarlenFlashKernel>(std::move(cu_seqlens), max_length, window);
}

}  // namespace lorastep
