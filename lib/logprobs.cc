#include "lib/logprobs.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "lib/torch_compat.h"

namespace lorastep {
namespace {

struct ChunkStats {
  at::Tensor logits;  // fp32 [c, V]
  at::Tensor lse;     // fp32 [c]
};

ChunkStats ChunkLogits(const at::Tensor& h, const at::Tensor& weight) {
  at::Tensor logits = at::mm(h, weight.t()).to(at::kFloat);
  return {logits, at::logsumexp(logits, -1)};
}

class TokenScoresFunction : public torch::autograd::Function<TokenScoresFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& hidden, const at::Tensor& weight,
                                                MainGradRef main_grad_ref,
                                                const at::Tensor& targets, int64_t chunk,
                                                bool fused, bool fp32_dgrad) {
    const at::Tensor& main_grad = main_grad_ref.tensor;
    const int64_t t = hidden.size(0);
    at::Tensor logprobs = at::empty({t}, hidden.options().dtype(at::kFloat));
    at::Tensor entropy = at::empty({t}, hidden.options().dtype(at::kFloat));
    for (int64_t start = 0; start < t; start += chunk) {
      const int64_t n = std::min(chunk, t - start);
      ChunkStats cs = ChunkLogits(hidden.narrow(0, start, n), weight);
      at::Tensor tgt = targets.narrow(0, start, n).unsqueeze(1);
      logprobs.narrow(0, start, n).copy_(cs.logits.gather(1, tgt).squeeze(1) - cs.lse);
      at::Tensor p = at::exp(cs.logits - cs.lse.unsqueeze(1));
      entropy.narrow(0, start, n).copy_(cs.lse - (p * cs.logits).sum(1));
    }
    // Leave the gradient of an unused output (entropy, when its coefficient is 0) undefined
    // rather than a tensor of zeros: backward then skips its passes over [chunk, V].
    ctx->set_materialize_grads(false);
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["fp32_dgrad"] = fp32_dgrad;
    ctx->saved_data["trainable"] = main_grad.defined();
    if (main_grad.defined()) ctx->saved_data["main_grad"] = main_grad;
    ctx->save_for_backward({hidden, weight, targets});
    return {logprobs, entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];
    const at::Tensor& g_lp = grads[0];
    const at::Tensor& g_ent = grads[1];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const bool trainable = ctx->saved_data["trainable"].toBool();
    const bool fused = ctx->saved_data["fused"].toBool();
    const bool fp32_dgrad = ctx->saved_data["fp32_dgrad"].toBool();
    const int64_t t = hidden.size(0);
    at::Tensor grad_hidden = ctx->needs_input_grad(0) ? at::empty_like(hidden) : at::Tensor();
    at::Tensor grad_weight;
    if (trainable && !fused) grad_weight = at::zeros_like(weight, at::kFloat);
    at::Tensor main_grad = trainable ? ctx->saved_data["main_grad"].toTensor() : at::Tensor();

    for (int64_t start = 0; start < t; start += chunk) {
      const int64_t n = std::min(chunk, t - start);
      at::Tensor h = hidden.narrow(0, start, n);
      ChunkStats cs = ChunkLogits(h, weight);
      at::Tensor p = at::exp(cs.logits - cs.lse.unsqueeze(1));
      // d logprob[target] / d z = onehot(target) - p
      at::Tensor gz = at::zeros_like(cs.logits);
      if (g_lp.defined()) {
        at::Tensor gl = g_lp.narrow(0, start, n).unsqueeze(1);
        gz = -p * gl;
        gz.scatter_add_(1, targets.narrow(0, start, n).unsqueeze(1), gl);
      }
      // d entropy / d z_j = -p_j (z_j - E_p[z])
      if (g_ent.defined()) {
        at::Tensor mean_z = (p * cs.logits).sum(1, /*keepdim=*/true);
        gz = gz - g_ent.narrow(0, start, n).unsqueeze(1) * p * (cs.logits - mean_z);
      }
      at::Tensor gz_model = gz.to(hidden.scalar_type());
      if (grad_hidden.defined()) {
        grad_hidden.narrow(0, start, n).copy_(LinearInputGrad(fp32_dgrad ? gz : gz_model, weight, fp32_dgrad));
      }
      if (trainable) {
        if (fused) {
          compat::AddMatmulFp32(main_grad, gz_model.t(), h);
        } else {
          grad_weight.addmm_(gz_model.t().to(at::kFloat), h.to(at::kFloat));
        }
      }
    }
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

TokenScores ChunkedTokenScores(const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& weight_main_grad, const at::Tensor& targets,
                               int64_t chunk_tokens, const GradOptions& grad) {
  auto out = TokenScoresFunction::apply(hidden, weight, MainGradRef{weight_main_grad}, targets,
                                        std::max<int64_t>(1, chunk_tokens), grad.fused_wgrad,
                                        grad.fp32_dgrad);
  return {out[0], out[1]};
}

}  // namespace lorastep
