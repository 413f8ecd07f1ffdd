#include "lib/model/attention_paths.h"

#include <algorithm>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "lib/model/sink_attention.h"
#include "lib/parallel/context_parallel.h"

namespace lorastep {
namespace {

// Attention in a selective replay: returns the kept output for (q, k, v) without running
// attention, and back-propagates as attention does. q/k/v are laid out as the kept kernel
// took them.
class KeptAttentionFunction : public torch::autograd::Function<KeptAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t kept_address) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["kept"] = kept_address;
    // A fresh tensor over the kept storage (not a view): autograd records this node as its history.
    return reinterpret_cast<const KeptAttention*>(kept_address)->out.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto* kept = reinterpret_cast<const KeptAttention*>(ctx->saved_data["kept"].toInt());
    switch (kept->kernel) {
      case KeptAttention::Kernel::kFlash: {
        auto [dq, dk, dv] = compat::VarlenCausalAttentionBackward(grads[0], saved[0], saved[1], saved[2], kept->flash,
                                                                  kept->cu_seqlens, kept->max_length);
        return {dq, dk, dv, at::Tensor()};
      }
      case KeptAttention::Kernel::kCudnn: {
        auto [dq, dk, dv] = compat::CudnnCausalAttentionBackward(grads[0], saved[0], saved[1], saved[2], kept->cudnn);
        return {dq, dk, dv, at::Tensor()};
      }
      case KeptAttention::Kernel::kSinkFlash: {
        auto g = SinkAttentionBackward(kept->sink, grads[0], saved[0], saved[1], saved[2], /*sinks_grad=*/false);
        return {g[0], g[1], g[2], at::Tensor()};
      }
      case KeptAttention::Kernel::kReplay:
        break;
    }
    torch::autograd::variable_list inputs;
    for (int j = 0; j < 3; ++j) inputs.push_back(saved[j].detach().requires_grad_(true));
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = kept->attend(inputs[0], inputs[1], inputs[2]);
    }
    torch::autograd::variable_list g = torch::autograd::grad({y}, inputs, {grads[0]});
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

}  // namespace

at::Tensor KeptAttentionOutput(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, KeptAttention* kept) {
  return KeptAttentionFunction::apply(q, k, v, reinterpret_cast<int64_t>(kept));
}

at::Tensor PackedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const PackedSequences& packed, int64_t window, const at::Tensor& sinks) {
  const int64_t total = q.size(1), width = q.size(2) * q.size(3);
  const int64_t length = packed.lengths.empty() ? 0 : packed.lengths.front();
  const auto count = static_cast<int64_t>(packed.lengths.size());
  const bool plain = window == 0 && !sinks.defined();
  if (plain && length > 0 && count * length == total &&
      std::all_of(packed.lengths.begin(), packed.lengths.end(), [&](int64_t n) { return n == length; })) {
    auto rows = [&](const at::Tensor& t) { return t.reshape({count, length, t.size(2), t.size(3)}).transpose(1, 2); };
    const at::Tensor qr = rows(q), kr = rows(k), vr = rows(v);
    if (compat::UsesCudnnAttention(qr, kr, vr)) {
      return compat::CausalAttention(qr, kr, vr).transpose(1, 2).reshape({1, total, width});
    }
  }
  if (sinks.defined() && UseSinkFlash(q)) {  // the sinks through the kernel's log-sum-exp
    return SinkAttentionThroughLse(q[0], k[0], v[0].contiguous(), sinks,
                                   VarlenFlashLseKernel(packed.cu_seqlens, packed.max_length, window))
        .reshape({1, total, width});
  }
  if (!sinks.defined() && compat::HasVarlenAttention(q)) {  // a sliding window skips the blocks outside it
    return compat::VarlenCausalAttention(q[0], k[0], v[0].contiguous(), packed.cu_seqlens, packed.max_length, window)
        .reshape({1, total, width});
  }
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t n : packed.lengths) {
    auto heads_first = [&](const at::Tensor& t) { return t.narrow(1, start, n).transpose(1, 2); };
    const at::Tensor qs = heads_first(q), ks = heads_first(k), vs = heads_first(v);
    parts.push_back(CausalOrMasked(qs, ks, vs, window, sinks).transpose(1, 2));
    start += n;
  }
  return at::cat(parts, 1).reshape({1, total, width});
}

at::Tensor CausalOrMasked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                          const at::Tensor& sinks) {
  if (sinks.defined()) return compat::SinkCausalAttention(q, k, v, window, sinks);
  return window > 0 ? compat::WindowedCausalAttention(q, k, v, window) : compat::CausalAttention(q, k, v);
}

at::Tensor ContextAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const PackedSequences& packed, int64_t window, const at::Tensor& sinks) {
  const int64_t t = q.size(1), width = q.size(2) * q.size(3);
  return ContextParallelAttention(q[0], k[0], v[0], packed.sequence_ids, packed.positions, packed.context_group,
                                  packed.context_counts, window, sinks)
      .reshape({1, t, width});
}

}  // namespace lorastep
