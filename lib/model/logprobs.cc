#include "lib/model/logprobs.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "lib/torch_compat.h"
#include "lib/torch_status.h"

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/kernel_launch.h"
#include "lib/kernels/token_scores.h"
#endif

namespace lorastep {
namespace {

#ifdef LORASTEP_WITH_CUDA_KERNELS
using kernels::KernelLaunch;
template <typename T>
T* PtrOrNull(const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }
#endif

// Whether this head's statistics and logit gradients run as lorastep's CUDA kernel.
bool UseTokenScoresKernel(const at::Tensor& hidden) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
  return hidden.is_cuda();
#else
  (void)hidden;
  return false;
#endif
}

struct ChunkStats {
  at::Tensor logits;  // fp32 [c, V]
  at::Tensor lse;     // fp32 [c]
};

ChunkStats ChunkLogits(const at::Tensor& h, const at::Tensor& weight) {
  at::Tensor logits = at::mm(h, weight.t()).to(at::kFloat);
  return {logits, at::logsumexp(logits, -1)};
}

CommGroup* GroupFromToken(int64_t t) { return reinterpret_cast<CommGroup*>(static_cast<intptr_t>(t)); }

void AllReduceOrThrow(at::Tensor& t, CommGroup* group, ReduceKind op = ReduceKind::kSum) {
  ThrowIfError(group->AllReduce(t, op));
}

// Vocab-parallel statistics of one chunk: this rank's logits [n, V_i] are a slice of the
// vocabulary. The global log-sum-exp is max-shifted (MAX all-reduce, then SUM of exp);
// the target's logit comes from the rank that holds it (SUM of masked gathers), and
// E_p[z] (for the entropy) is a SUM of local parts. Three small all-reduces per chunk;
// full logits never leave their rank.
struct ParallelChunk {
  at::Tensor logits;  // fp32 [n, V_i]
  at::Tensor lse;     // fp32 [n], global
  at::Tensor target;  // fp32 [n], the target's logit
  at::Tensor ez;      // fp32 [n], E_p[z] over the whole vocabulary
};

ParallelChunk ParallelChunkStats(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& tgt,
                                 int64_t vocab_begin, CommGroup* group) {
  ParallelChunk c;
  c.logits = at::mm(h, weight.t()).to(at::kFloat);
  at::Tensor m = std::get<0>(c.logits.max(1)).contiguous();
  AllReduceOrThrow(m, group, ReduceKind::kMax);
  at::Tensor sumexp = at::exp(c.logits - m.unsqueeze(1)).sum(1).contiguous();
  AllReduceOrThrow(sumexp, group);
  c.lse = m + at::log(sumexp);
  const int64_t rows = weight.size(0);
  at::Tensor local = tgt - vocab_begin;
  at::Tensor in_range = (local >= 0) & (local < rows);
  at::Tensor idx = at::where(in_range, local, at::zeros_like(local)).unsqueeze(1);
  at::Tensor p = at::exp(c.logits - c.lse.unsqueeze(1));
  at::Tensor parts = at::stack({c.logits.gather(1, idx).squeeze(1) * in_range.to(at::kFloat),
                                (p * c.logits).sum(1)}).contiguous();
  AllReduceOrThrow(parts, group);
  c.target = parts[0];
  c.ez = parts[1];
  return c;
}

class TokenScoresFunction : public torch::autograd::Function<TokenScoresFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& hidden, const at::Tensor& weight,
                                                MainGradRef main_grad_ref,
                                                const at::Tensor& targets, int64_t chunk,
                                                bool fused, bool fp32_dgrad, int64_t group_token,
                                                int64_t vocab_begin, int64_t trainable_from_col) {
    const at::Tensor& main_grad = main_grad_ref.tensor;
    const int64_t t = hidden.size(0);
    CommGroup* group = GroupFromToken(group_token);
    at::Tensor logprobs = at::empty({t}, hidden.options().dtype(at::kFloat));
    at::Tensor entropy = at::empty({t}, hidden.options().dtype(at::kFloat));
    at::Tensor lse_all, ez_all;  // kept for backward on the vocab-parallel path and the kernel's
    const bool kernel = group == nullptr && !fp32_dgrad && UseTokenScoresKernel(hidden);
    if (group != nullptr || kernel) lse_all = at::empty({t}, hidden.options().dtype(at::kFloat));
    if (group != nullptr) ez_all = at::empty({t}, hidden.options().dtype(at::kFloat));
    for (int64_t start = 0; start < t; start += chunk) {
      const int64_t n = std::min(chunk, t - start);
#ifdef LORASTEP_WITH_CUDA_KERNELS
      if (kernel) {  // statistics in one pass per row; backward recomputes the logits
        at::Tensor logits = at::mm(hidden.narrow(0, start, n), weight.t());
        at::Tensor tgt = targets.narrow(0, start, n).contiguous();
        const KernelLaunch launch(logits);
        const char* error = kernels::LaunchTokenScores(
            logits.data_ptr(), kernels::ElementTypeOf(logits), n, logits.size(1), logits.stride(0), tgt.data_ptr<int64_t>(),
            logprobs.narrow(0, start, n).data_ptr<float>(), entropy.narrow(0, start, n).data_ptr<float>(),
            lse_all.narrow(0, start, n).data_ptr<float>(), nullptr, nullptr, launch.stream);
        TORCH_CHECK(error == nullptr, "token scores kernel: ", error);
        continue;
      }
#endif
      if (group != nullptr) {
        ParallelChunk pc = ParallelChunkStats(hidden.narrow(0, start, n), weight,
                                              targets.narrow(0, start, n), vocab_begin, group);
        logprobs.narrow(0, start, n).copy_(pc.target - pc.lse);
        entropy.narrow(0, start, n).copy_(pc.lse - pc.ez);
        lse_all.narrow(0, start, n).copy_(pc.lse);
        ez_all.narrow(0, start, n).copy_(pc.ez);
        continue;
      }
      ChunkStats cs = ChunkLogits(hidden.narrow(0, start, n), weight);
      at::Tensor tgt = targets.narrow(0, start, n).unsqueeze(1);
      logprobs.narrow(0, start, n).copy_(cs.logits.gather(1, tgt).squeeze(1) - cs.lse);
      at::Tensor p = at::exp(cs.logits - cs.lse.unsqueeze(1));
      entropy.narrow(0, start, n).copy_(cs.lse - (p * cs.logits).sum(1));
    }
    ctx->saved_data["group"] = group_token;
    ctx->saved_data["vocab_begin"] = vocab_begin;
    ctx->saved_data["kernel"] = kernel;
    if (group != nullptr) {
      ctx->saved_data["lse"] = lse_all;
      ctx->saved_data["ez"] = ez_all;
    }
    if (kernel) {
      ctx->saved_data["lse"] = lse_all;
      ctx->saved_data["entropy"] = entropy.detach();  // detached: no cycle through this node
    }
    // Leave the gradient of an unused output (entropy, when its coefficient is 0) undefined
    // rather than a tensor of zeros: backward then skips its passes over [chunk, V].
    ctx->set_materialize_grads(false);
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["fp32_dgrad"] = fp32_dgrad;
    ctx->saved_data["trainable"] = main_grad.defined();
    ctx->saved_data["from_col"] = trainable_from_col;
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
    const int64_t from_col = ctx->saved_data["from_col"].toInt();
    at::Tensor grad_weight;
    if (trainable && !fused && from_col == 0) grad_weight = at::zeros_like(weight, at::kFloat);
    at::Tensor main_grad = trainable ? ctx->saved_data["main_grad"].toTensor() : at::Tensor();
    CommGroup* group = GroupFromToken(ctx->saved_data["group"].toInt());
    const int64_t vocab_begin = ctx->saved_data["vocab_begin"].toInt();

    const bool kernel = ctx->saved_data["kernel"].toBool();
    for (int64_t start = 0; start < t; start += chunk) {
      const int64_t n = std::min(chunk, t - start);
      at::Tensor h = hidden.narrow(0, start, n);
      at::Tensor gz, gz_model;
#ifdef LORASTEP_WITH_CUDA_KERNELS
      if (kernel) {  // the logits' gradient in the model dtype, one pass per row
        at::Tensor logits = at::mm(h, weight.t());
        gz_model = at::empty_like(logits);
        at::Tensor tgt = targets.narrow(0, start, n).contiguous();
        at::Tensor gl = g_lp.defined() ? g_lp.narrow(0, start, n).contiguous() : at::Tensor();
        at::Tensor ge = g_ent.defined() ? g_ent.narrow(0, start, n).contiguous() : at::Tensor();
        const KernelLaunch launch(logits);
        const char* error = kernels::LaunchTokenScoresGrad(
            logits.data_ptr(), kernels::ElementTypeOf(logits), n, logits.size(1), logits.stride(0), tgt.data_ptr<int64_t>(),
            ctx->saved_data["lse"].toTensor().narrow(0, start, n).data_ptr<float>(),
            ctx->saved_data["entropy"].toTensor().narrow(0, start, n).data_ptr<float>(), PtrOrNull<float>(gl),
            PtrOrNull<float>(ge), gz_model.data_ptr(), launch.stream);
        TORCH_CHECK(error == nullptr, "token scores gradient kernel: ", error);
      }
#endif
      if (!kernel) {  // fp32 ATen passes (CPU, the vocab-parallel head, fp32 dgrad)
        ChunkStats cs;
        at::Tensor mean_z;
        at::Tensor tgt = targets.narrow(0, start, n);
        if (group != nullptr) {
          cs.logits = at::mm(h, weight.t()).to(at::kFloat);
          cs.lse = ctx->saved_data["lse"].toTensor().narrow(0, start, n);
          mean_z = ctx->saved_data["ez"].toTensor().narrow(0, start, n).unsqueeze(1);
          tgt = tgt - vocab_begin;  // local row; out-of-slice targets get no one-hot term
        } else {
          cs = ChunkLogits(h, weight);
        }
        at::Tensor p = at::exp(cs.logits - cs.lse.unsqueeze(1));
        // d logprob[target] / d z = onehot(target) - p
        gz = at::zeros_like(cs.logits);
        if (g_lp.defined()) {
          at::Tensor gl = g_lp.narrow(0, start, n).unsqueeze(1);
          gz = -p * gl;
          if (group != nullptr) {
            at::Tensor in_range = (tgt >= 0) & (tgt < weight.size(0));
            at::Tensor idx = at::where(in_range, tgt, at::zeros_like(tgt)).unsqueeze(1);
            gz.scatter_add_(1, idx, gl * in_range.unsqueeze(1).to(at::kFloat));
          } else {
            gz.scatter_add_(1, tgt.unsqueeze(1), gl);
          }
        }
        // d entropy / d z_j = -p_j (z_j - E_p[z])
        if (g_ent.defined()) {
          if (!mean_z.defined()) mean_z = (p * cs.logits).sum(1, /*keepdim=*/true);
          gz = gz - g_ent.narrow(0, start, n).unsqueeze(1) * p * (cs.logits - mean_z);
        }
        gz_model = gz.to(hidden.scalar_type());
      }
      if (grad_hidden.defined()) {
        at::Tensor gh = LinearInputGrad(fp32_dgrad ? gz : gz_model, weight, fp32_dgrad);
        // Each rank holds the part of dL/dh from its vocabulary slice: SUM over the group.
        if (group != nullptr) {
          gh = gh.contiguous();
          AllReduceOrThrow(gh, group);
        }
        grad_hidden.narrow(0, start, n).copy_(gh);
      }
      if (trainable) {
        if (from_col > 0) {  // only the trailing columns train: their product alone
          compat::AddMatmulFp32(main_grad, gz_model.t(), h.narrow(1, from_col, h.size(1) - from_col));
        } else if (fused) {
          compat::AddMatmulFp32(main_grad, gz_model.t(), h);
        } else {
          grad_weight.addmm_(gz_model.t().to(at::kFloat), h.to(at::kFloat));
        }
      }
    }
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A frozen LM head (LoRA training, or no gradient at all). Backward needs the logits only
// through two [T, H] products, so forward computes them while each chunk's logits exist and
// backward never recomputes the logits or passes over [chunk, V] again:
//   d logprob_t / d h_t = W[y_t] - p_t W                       (p_t W = E_p[W])
//   d entropy_t / d h_t = -(p_t * lf_t) W - entropy_t p_t W    (lf = log-softmax)
// (the second only when the loss differentiates the entropy).
class FrozenHeadScoresFunction : public torch::autograd::Function<FrozenHeadScoresFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& hidden, const at::Tensor& weight,
                                                const at::Tensor& targets, int64_t chunk,
                                                bool prepare_grad, bool entropy_grad) {
    const int64_t t = hidden.size(0);
    const auto f32 = hidden.options().dtype(at::kFloat);
    at::Tensor logprobs = at::empty({t}, f32), entropy = at::empty({t}, f32);
    at::Tensor expected_w, entropy_w;  // [T, H] fp32: p W and (p * lf) W
    if (prepare_grad) expected_w = at::empty({t, hidden.size(1)}, f32);
    if (prepare_grad && entropy_grad) entropy_w = at::empty({t, hidden.size(1)}, f32);
    for (int64_t start = 0; start < t; start += chunk) {
      const int64_t n = std::min(chunk, t - start);
      at::Tensor logits = at::mm(hidden.narrow(0, start, n), weight.t());
#ifdef LORASTEP_WITH_CUDA_KERNELS
      if (logits.is_cuda()) {  // one pass over each row for the statistics, one to write p
        at::Tensor p = expected_w.defined() ? at::empty_like(logits) : at::Tensor();
        at::Tensor plp = entropy_w.defined() ? at::empty_like(logits) : at::Tensor();
        at::Tensor tgt = targets.narrow(0, start, n).contiguous();
        const KernelLaunch launch(logits);
        const char* error = kernels::LaunchTokenScores(
            logits.data_ptr(), kernels::ElementTypeOf(logits), n, logits.size(1), logits.stride(0), tgt.data_ptr<int64_t>(),
            logprobs.narrow(0, start, n).data_ptr<float>(), entropy.narrow(0, start, n).data_ptr<float>(),
            /*lse_out=*/nullptr, p.defined() ? p.data_ptr() : nullptr, plp.defined() ? plp.data_ptr() : nullptr,
            launch.stream);
        TORCH_CHECK(error == nullptr, "token scores kernel: ", error);
        if (p.defined()) expected_w.narrow(0, start, n).copy_(at::mm(p, weight));
        if (plp.defined()) entropy_w.narrow(0, start, n).copy_(at::mm(plp, weight));
        continue;
      }
#endif
      at::Tensor lf = at::log_softmax(logits, 1, at::kFloat);
      logprobs.narrow(0, start, n).copy_(lf.gather(1, targets.narrow(0, start, n).unsqueeze(1)).squeeze(1));
      at::Tensor p = lf.exp();
      // -sum_v p lf as a batched dot product: no [n, V] temporary.
      entropy.narrow(0, start, n).copy_(at::bmm(p.unsqueeze(1), lf.unsqueeze(2)).view({n}).neg());
      if (expected_w.defined()) expected_w.narrow(0, start, n).copy_(at::mm(p.to(weight.scalar_type()), weight));
      if (entropy_w.defined()) {
        entropy_w.narrow(0, start, n).copy_(at::mm(p.mul_(lf).to(weight.scalar_type()), weight));
      }
    }
    ctx->set_materialize_grads(false);
    ctx->saved_data["entropy_grad"] = entropy_w.defined();
    ctx->save_for_backward({weight, targets, expected_w, entropy_w, entropy});
    return {logprobs, entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &weight = saved[0], &targets = saved[1], &expected_w = saved[2],
                     &entropy_w = saved[3], &entropy = saved[4];
    const at::Tensor &g_lp = grads[0], &g_ent = grads[1];
    TORCH_CHECK(expected_w.defined(), "log-prob gradient of a forward run without gradients");
    at::Tensor gh = at::zeros_like(expected_w);
    if (g_lp.defined()) {
      gh.add_(g_lp.unsqueeze(1) * (weight.index_select(0, targets).to(at::kFloat) - expected_w));
    }
    if (g_ent.defined()) {
      TORCH_CHECK(ctx->saved_data["entropy_grad"].toBool(),
                  "entropy gradient of a forward run with entropy_grad off");
      gh.sub_(g_ent.unsqueeze(1) * (entropy_w + entropy.unsqueeze(1) * expected_w));
    }
    return {gh.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TokenScores ChunkedTokenScores(const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& weight_main_grad, const at::Tensor& targets,
                               int64_t chunk_tokens, const GradOptions& grad,
                               const VocabShard& vocab, bool entropy_grad, int64_t trainable_from_col) {
  CommGroup* group = vocab.group != nullptr && vocab.group->size() > 1 ? vocab.group : nullptr;
  if (group == nullptr && !weight_main_grad.defined()) {
    const bool prepare = at::GradMode::is_enabled() && hidden.requires_grad();
    auto out = FrozenHeadScoresFunction::apply(hidden, weight, targets, std::max<int64_t>(1, chunk_tokens),
                                               prepare, entropy_grad);
    return {out[0], out[1]};
  }
  auto out = TokenScoresFunction::apply(hidden, weight, MainGradRef{weight_main_grad}, targets,
                                        std::max<int64_t>(1, chunk_tokens), grad.fused_wgrad,
                                        grad.fp32_dgrad,
                                        static_cast<int64_t>(reinterpret_cast<intptr_t>(group)),
                                        vocab.begin, trainable_from_col);
  return {out[0], out[1]};
}

}  // namespace lorastep
