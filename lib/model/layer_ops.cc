// The element-wise pieces of a decoder layer with their own autograd nodes: SwiGLU, RoPE,
// RMSNorm (with the residual add before it), LoRA dropout. On CUDA they run as lorastep's
// fused kernels where UseFusedKernels says so; elsewhere as ATen compositions with the same
// rounding.
#include "lib/model/layer_ops.h"

#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "lib/env_switch.h"

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/fused_layer.h"
#include "lib/kernels/kernel_launch.h"
#endif

namespace lorastep {

namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// silu(gate) * up over gate/up given as `first` (contiguous) and `second`, or packed as the
// halves of `first` [.., 2f] (LoraLinearGroup's output).
at::Tensor SwiGluValue(const at::Tensor& first, const at::Tensor& second, bool packed) {
  const int64_t f = packed ? first.size(-1) / 2 : first.size(-1);
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (UseFusedKernels(first, second)) {
    std::vector<int64_t> shape(first.sizes().begin(), first.sizes().end());
    shape.back() = f;
    at::Tensor out = at::empty(shape, first.options());
    const int64_t rows = out.numel() / f;
    const kernels::KernelLaunch launch(first);
    const auto* base = static_cast<const char*>(first.data_ptr());
    const void* up_ptr = packed ? base + f * first.element_size() : second.data_ptr();
    kernels::CheckLaunch(kernels::LaunchSwiGlu(first.data_ptr(), up_ptr, kernels::ElementTypeOf(first), rows, f,
                                               packed ? 2 * f : f, out.data_ptr(), launch.stream),
                         "swiglu");
    return out;
  }
#endif
  const at::Tensor gate = packed ? first.narrow(-1, 0, f) : first;
  const at::Tensor up = packed ? first.narrow(-1, f, f) : second;
  return at::silu(gate).mul_(up);
}

// The gradients of SwiGluValue for its output's gradient g: {grad_gate_up} when packed, else
// {grad_gate, grad_up}. With `act` non-null it also receives SwiGluValue's output, the same
// bits (one more store in the pass on CUDA).
std::vector<at::Tensor> SwiGluGrads(const at::Tensor& first, const at::Tensor& second, bool packed,
                                    const at::Tensor& grad, at::Tensor* act) {
  const at::Tensor g = grad.contiguous();
  const int64_t f = g.size(-1);
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (UseFusedKernels(first, g)) {
    const int64_t rows = g.numel() / f;
    const kernels::KernelLaunch launch(first);
    const auto* base = static_cast<const char*>(first.data_ptr());
    const void* up_ptr = packed ? base + f * first.element_size() : second.data_ptr();
    void* act_ptr = nullptr;
    if (act != nullptr) *act = at::empty_like(g), act_ptr = act->data_ptr();
    if (packed) {
      at::Tensor grad_packed = at::empty_like(first);
      auto* out = static_cast<char*>(grad_packed.data_ptr());
      kernels::CheckLaunch(kernels::LaunchSwiGluGrad(g.data_ptr(), first.data_ptr(), up_ptr, kernels::ElementTypeOf(first),
                                                     rows, f, 2 * f, 2 * f, out, out + f * grad_packed.element_size(),
                                                     act_ptr, launch.stream),
                           "swiglu gradient");
      return {grad_packed};
    }
    at::Tensor grad_gate = at::empty_like(first), grad_up = at::empty_like(second);
    kernels::CheckLaunch(kernels::LaunchSwiGluGrad(g.data_ptr(), first.data_ptr(), up_ptr, kernels::ElementTypeOf(first),
                                                   rows, f, f, f, grad_gate.data_ptr(), grad_up.data_ptr(), act_ptr,
                                                   launch.stream),
                         "swiglu gradient");
    return {grad_gate, grad_up};
  }
#endif
  const at::Tensor gate = packed ? first.narrow(-1, 0, f) : first;
  const at::Tensor up = packed ? first.narrow(-1, f, f) : second;
  const at::Tensor silu = at::silu(gate);
  if (act != nullptr) *act = silu * up;
  at::Tensor grad_gate = at::silu_backward(g * up, gate), grad_up = g * silu;
  if (packed) return {at::cat({grad_gate, grad_up}, -1)};
  return {grad_gate, grad_up};
}

// silu(gate) * up keeping only gate and up for backward (autograd of the composition also
// keeps silu(gate): another [tokens, intermediate] tensor per layer). Two forms: gate and up
// as separate tensors, or packed as the halves of one [.., 2f] projection (LoraLinearGroup's
// output), whose gradient then comes back packed too (no copies either way on CUDA).
class SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
 public:
  // gate_up [.., 2f] when `packed`, else gate [.., f] and up [.., f].
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_or_packed,
                            const at::Tensor& up, bool packed) {
    ctx->saved_data["packed"] = packed;
    const at::Tensor first = gate_or_packed.contiguous();
    const at::Tensor second = packed ? first : up.contiguous();
    ctx->save_for_backward({first, second});
    return SwiGluValue(first, second, packed);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> out = SwiGluGrads(saved[0], saved[1], ctx->saved_data["packed"].toBool(), grads[0],
                                              /*act=*/nullptr);
    out.resize(3);
    return out;
  }
};

// Rotary embedding of x [b, s, heads, d] with cos/sin tables [s, d]: x * cos +
// rotate_half(x) * sin. The backward map is the transpose (x * cos + rotate_half^T(x * sin)).
at::Tensor RopeComposite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos.unsqueeze(1) + RotateHalf(x) * sin.unsqueeze(1);
}

#ifdef LORASTEP_WITH_CUDA_KERNELS
// RoPE of x [b, s, heads, d] (unit stride along d) as a new contiguous tensor, or into `into`
// when defined: a [b, s, heads, d] view with unit stride along d, heads d apart and batches
// s tokens apart (a column slice of a packed gradient).
at::Tensor RopeKernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                      const at::Tensor& into = at::Tensor()) {
  const at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();  // any layout with unit stride along d
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor y = into.defined() ? into : at::empty(xs.sizes(), xs.options());
  const int64_t strides[3] = {xs.stride(0), xs.stride(1), xs.stride(2)};
  const kernels::KernelLaunch launch(xs);
  kernels::CheckLaunch(kernels::LaunchRope(xs.data_ptr(), strides, c.data_ptr(), sn.data_ptr(), /*positions=*/nullptr,
                                           kernels::ElementTypeOf(xs), xs.size(0), xs.size(1), xs.size(2), xs.size(3),
                                           backward, y.data_ptr(), y.stride(1), launch.stream),
                       "rope");
  return y;
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return RopeKernel(x, cos, sin, /*backward=*/false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    return {RopeKernel(grads[0], saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }
};

// (RoPE(q), RoPE(k), v) from one packed projection qkv [b, s, (heads + 2 kv_heads) d]: the
// kernels read the column slices in place, and backward writes all three gradients straight
// into one packed gradient (autograd of three narrows zero-fills three full-width tensors,
// copies into them and adds them up: most of the 7B step's copies).
class QkvRopeFunction : public torch::autograd::Function<QkvRopeFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                                                const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                                int64_t kv_heads) {
    const int64_t b = qkv.size(0), s = qkv.size(1), d = qkv.size(2) / (heads + 2 * kv_heads);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["shape"] = qkv.sizes().vec();
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["kv_heads"] = kv_heads;
    const at::Tensor q = qkv.narrow(-1, 0, heads * d).view({b, s, heads, d});
    const at::Tensor k = qkv.narrow(-1, heads * d, kv_heads * d).view({b, s, kv_heads, d});
    const at::Tensor v = qkv.narrow(-1, (heads + kv_heads) * d, kv_heads * d).view({b, s, kv_heads, d});
    return {RopeKernel(q, cos, sin, /*backward=*/false), RopeKernel(k, cos, sin, /*backward=*/false), v.contiguous()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const int64_t heads = ctx->saved_data["heads"].toInt(), kv_heads = ctx->saved_data["kv_heads"].toInt();
    const int64_t b = shape[0], s = shape[1], d = shape[2] / (heads + 2 * kv_heads);
    at::Tensor grad = at::empty(shape, saved[0].options());
    const int64_t starts[3] = {0, heads * d, (heads + kv_heads) * d}, counts[3] = {heads, kv_heads, kv_heads};
    for (int part = 0; part < 3; ++part) {
      at::Tensor slice = grad.narrow(-1, starts[part], counts[part] * d).view({b, s, counts[part], d});
      if (!grads[part].defined()) {
        slice.zero_();
      } else if (part < 2) {
        RopeKernel(grads[part], saved[0], saved[1], /*backward=*/true, slice);
      } else {
        slice.copy_(grads[part]);
      }
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

// transformers' RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)).to(dtype) with the statistics
// in fp32; *rstd receives the per-row 1/rms (fp32, [.., 1]) for backward. With `residual`
// defined the norm is of x + residual, which *sum receives (one kernel on CUDA). x and
// residual contiguous on CUDA. With `room` > 0 the result is the left block of a
// [.., hidden + room] buffer whose right columns are free for the next projection's fold
// (LoraLinearGroup's input_has_room): the kernel writes the rows that far apart.
at::Tensor RmsNormValue(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                        at::Tensor* sum, at::Tensor* rstd, int64_t room = 0) {
  const int64_t hidden = x.size(-1);
  std::vector<int64_t> wide(x.sizes().begin(), x.sizes().end());
  wide.back() = hidden + room;
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (UseFusedKernels(x, weight) && (!residual.defined() || residual.sizes() == x.sizes())) {
    const at::Tensor w = weight.contiguous();
    const at::Tensor r = residual.defined() ? residual.contiguous() : residual;
    at::Tensor y = at::empty(wide, x.options());
    if (r.defined()) *sum = at::empty_like(x);
    std::vector<int64_t> rstd_shape(x.sizes().begin(), x.sizes().end());
    rstd_shape.back() = 1;
    *rstd = at::empty(rstd_shape, x.options().dtype(at::kFloat));
    const kernels::KernelLaunch launch(x);
    kernels::CheckLaunch(kernels::LaunchRmsNorm(x.data_ptr(), r.defined() ? r.data_ptr() : nullptr, w.data_ptr(),
                                                kernels::ElementTypeOf(x), x.numel() / hidden, hidden,
                                                static_cast<float>(eps), r.defined() ? sum->data_ptr() : nullptr,
                                                y.data_ptr(), hidden + room, rstd->data_ptr<float>(), launch.stream),
                         "rmsnorm");
    return room > 0 ? y.narrow(-1, 0, hidden) : y;
  }
#endif
  if (residual.defined()) {
    *sum = x + residual;
    return RmsNormValue(*sum, at::Tensor(), weight, eps, nullptr, rstd, room);
  }
  at::Tensor xf = x.to(at::kFloat);
  *rstd = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add_(eps));
  at::Tensor y = weight * (xf * *rstd).to(x.scalar_type());  // xf may be x itself (fp32)
  if (room == 0) return y;
  return at::empty(wide, x.options()).narrow(-1, 0, hidden).copy_(y);
}

// The input gradient of RmsNormValue for its output's gradient g, plus `residual` (x's
// gradient along the residual stream, undefined for none) added in the same pass on CUDA.
at::Tensor RmsNormInputGrad(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                            const at::Tensor& g, const at::Tensor& residual) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (UseFusedKernels(x, g)) {
    const at::Tensor gc = g.contiguous(), w = weight.contiguous();
    const at::Tensor rc = residual.defined() ? residual.contiguous() : residual;
    at::Tensor grad_x = at::empty_like(x);
    const kernels::KernelLaunch launch(x);
    kernels::CheckLaunch(
        kernels::LaunchRmsNormGrad(gc.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr<float>(),
                                   rc.defined() ? rc.data_ptr() : nullptr, kernels::ElementTypeOf(x),
                                   x.numel() / x.size(-1), x.size(-1), grad_x.data_ptr(), launch.stream),
        "rmsnorm gradient");
    return grad_x;
  }
#endif
  at::Tensor normed = x.to(at::kFloat) * rstd;  // recomputed: one [.., H] fp32 pass
  at::Tensor gn = (g * weight).to(at::kFloat);  // d loss / d normed, rounded as autograd would
  at::Tensor dot = (gn * normed).mean(-1, /*keepdim=*/true);
  at::Tensor grad_x = gn.sub_(normed.mul_(dot)).mul_(rstd).to(x.scalar_type());
  return residual.defined() ? grad_x.add_(residual) : grad_x;
}

// The norm weight's gradient (full fine-tuning trains the norms).
at::Tensor RmsNormWeightGrad(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                             const at::Tensor& g) {
  at::Tensor prod = (g * (x.to(at::kFloat) * rstd).to(x.scalar_type())).to(at::kFloat);
  return prod.reshape({-1, prod.size(-1)}).sum(0).to(weight.scalar_type());
}

// RMSNorm keeping only x and the per-row 1/rms for backward (autograd of the composition
// keeps several fp32 copies of x per norm: most of a LoRA step's activation memory after the MLP).
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps, int64_t room) {
    const at::Tensor xc = UseFusedKernels(x, weight) ? x.contiguous() : x;
    at::Tensor rstd;
    at::Tensor y = RmsNormValue(xc, at::Tensor(), weight, eps, nullptr, &rstd, room);
    ctx->save_for_backward({xc, weight, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    at::Tensor grad_w = ctx->needs_input_grad(1) ? RmsNormWeightGrad(x, weight, rstd, grads[0]) : at::Tensor();
    return {RmsNormInputGrad(x, weight, rstd, grads[0], at::Tensor()), grad_w, at::Tensor(), at::Tensor()};
  }
};

// (x + y, RMSNorm(x + y)): the residual add before a norm. Backward adds the sum's gradient
// along the residual stream inside the norm's gradient pass (on CUDA), where autograd of the
// two ops would run one more full-width add per norm.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& y, const at::Tensor& weight, double eps,
                                                int64_t room) {
    at::Tensor sum, rstd;
    const bool fused = UseFusedKernels(x, weight) && UseFusedKernels(y, weight);
    at::Tensor normed =
        RmsNormValue(fused ? x.contiguous() : x, fused ? y.contiguous() : y, weight, eps, &sum, &rstd, room);
    ctx->save_for_backward({sum, weight, rstd});
    return {sum, normed};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor &grad_sum = grads[0], &grad_normed = grads[1];
    at::Tensor grad_w, grad;
    if (grad_normed.defined()) {
      if (ctx->needs_input_grad(2)) grad_w = RmsNormWeightGrad(sum, weight, rstd, grad_normed);
      grad = RmsNormInputGrad(sum, weight, rstd, grad_normed, grad_sum);
    } else {
      grad = grad_sum;
    }
    return {grad, grad, grad_w, at::Tensor(), at::Tensor()};
  }
};


}  // namespace

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) { return SwiGluFunction::apply(gate, up, false); }
// gate_up [.., 2f]: the gate half, then the up half.
at::Tensor SwiGluPacked(const at::Tensor& gate_up) { return SwiGluFunction::apply(gate_up, gate_up, true); }

namespace {

#ifdef LORASTEP_WITH_CUDA_KERNELS
// gpt-oss's clamped SwiGLU as one kernel each way (kernels::LaunchClampedSwiGlu), keeping
// gate_up for backward; the same rounding as ClampedSwiGluPacked's composition.
class ClampedSwiGluFunction : public torch::autograd::Function<ClampedSwiGluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up, double alpha,
                            double limit) {
    const at::Tensor in = gate_up.contiguous();
    const int64_t f = in.size(-1) / 2;
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape.back() = f;
    at::Tensor out = at::empty(shape, in.options());
    const auto* base = static_cast<const char*>(in.data_ptr());
    const kernels::KernelLaunch launch(in);
    kernels::CheckLaunch(kernels::LaunchClampedSwiGlu(in.data_ptr(), base + f * in.element_size(),
                                                      kernels::ElementTypeOf(in), out.numel() / f, f, 2 * f,
                                                      static_cast<float>(alpha), static_cast<float>(limit),
                                                      out.data_ptr(), launch.stream),
                         "clamped swiglu");
    ctx->save_for_backward({in});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor in = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    const int64_t f = in.size(-1) / 2;
    at::Tensor grad = at::empty_like(in);
    const auto* base = static_cast<const char*>(in.data_ptr());
    auto* grad_base = static_cast<char*>(grad.data_ptr());
    const kernels::KernelLaunch launch(in);
    kernels::CheckLaunch(
        kernels::LaunchClampedSwiGluGrad(g.data_ptr(), in.data_ptr(), base + f * in.element_size(),
                                         kernels::ElementTypeOf(in), g.numel() / f, f, 2 * f, 2 * f,
                                         static_cast<float>(ctx->saved_data["alpha"].toDouble()),
                                         static_cast<float>(ctx->saved_data["limit"].toDouble()), grad_base,
                                         grad_base + f * in.element_size(), launch.stream),
        "clamped swiglu gradient");
    return {grad, at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor ClampedSwiGluKernel(const at::Tensor& gate_up, double alpha, double limit) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && UseFusedKernels(gate_up, gate_up)) {
    return ClampedSwiGluFunction::apply(gate_up, alpha, limit);
  }
#else
  (void)gate_up, (void)alpha, (void)limit;
#endif
  return at::Tensor();
}

at::Tensor ClampedSwiGluPacked(const at::Tensor& gate_up, double alpha, double limit) {
  static const bool fused = EnvSwitchOn("LORASTEP_FUSED_CLAMPED_SWIGLU");
  if (fused) {
    if (at::Tensor out = ClampedSwiGluKernel(gate_up, alpha, limit); out.defined()) return out;
  }
  const int64_t f = gate_up.size(-1) / 2;
  const at::Tensor gate = gate_up.narrow(-1, 0, f).clamp_max(limit);
  const at::Tensor up = gate_up.narrow(-1, f, f).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

// down_proj's input as a RecomputedInput of a packed gate_up: LoraLinearRecomputed then keeps
// gate_up (which the SwiGLU gradient needs anyway) and not the activation, a third of a
// dense layer's saved activations; SwiGluGrads rewrites the activation in its pass.
const RecomputedInput kSwiGluOfPacked{
    [](const at::Tensor& gate_up) { const at::Tensor c = gate_up.contiguous(); return SwiGluValue(c, c, true); },
    [](const at::Tensor& gate_up, const at::Tensor& grad_act, at::Tensor* act) {
      return SwiGluGrads(gate_up, gate_up, /*packed=*/true, grad_act, act)[0];
    }};

at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (UseFusedKernels(x, cos)) return RopeFunction::apply(x, cos, sin);
#endif
  return RopeComposite(x, cos, sin);
}

#ifdef LORASTEP_WITH_CUDA_KERNELS
std::vector<at::Tensor> QkvRope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                int64_t kv_heads) {
  return QkvRopeFunction::apply(qkv, cos, sin, heads, kv_heads);
}
#endif

// Inverted dropout with the run's own generator (at::dropout would use the global one,
// which runs sharing a process would perturb for each other).
at::Tensor LoraDropout(const at::Tensor& x, double p, at::Generator* generator) {
  at::Tensor keep = at::empty(x.sizes(), at::kFloat);
  if (generator != nullptr) {
    keep.bernoulli_(1.0 - p, *generator);
  } else {
    keep.bernoulli_(1.0 - p);
  }
  return x * (keep.to(x.options()) / (1.0 - p));
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t room) {
  return RmsNormFunction::apply(x, weight, eps, room);
}

std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                                             double eps, int64_t room) {
  if (!y.defined()) return {x, RmsNorm(x, weight, eps, room)};
  auto out = AddRmsNormFunction::apply(x, y, weight, eps, room);
  return {out[0], out[1]};
}

}  // namespace lorastep
