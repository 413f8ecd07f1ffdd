#include "lib/model/qwen2.h"

#include <cmath>

#include "lib/torch_compat.h"

namespace lorastep {
namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// cos/sin tables [s, head_dim] as Hugging Face computes them (fp32, then cast).
std::pair<at::Tensor, at::Tensor> RopeTables(const ModelConfig& c, int64_t s,
                                             const at::TensorOptions& options) {
  const int64_t d = c.head_dim();
  at::Tensor inv_freq =
      1.0 / at::pow(c.rope_theta, at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d));
  at::Tensor pos = at::arange(s, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1).to(options.device());
  return {emb.cos().to(options.dtype()), emb.sin().to(options.dtype())};
}

class LayerRunner {
 public:
  LayerRunner(const ModelConfig& c, const ModelWeights& weights, const ModelWeights* main_grads,
              const Adapter* adapter, const ForwardOptions& options)
      : c_(c), weights_(weights), main_grads_(main_grads), adapter_(adapter), options_(options) {}

  // One linear of layer `layer`: frozen or trainable base, plus the LoRA branch if any.
  at::Tensor Project(size_t layer, int slot, const at::Tensor& x) const {
    const at::Tensor& w = weights_.layers[layer].linear[slot];
    at::Tensor mg = main_grads_ != nullptr ? main_grads_->layers[layer].linear[slot] : at::Tensor();
    at::Tensor y = Linear(x, w, mg, options_.grad);
    if (slot < 3 && weights_.layers[layer].qkv_bias[slot].defined()) {
      y = y + weights_.layers[layer].qkv_bias[slot];
    }
    const LoraFactors* f = adapter_ != nullptr ? adapter_->lora(layer, slot) : nullptr;
    if (f != nullptr) {
      const Parameter& a = adapter_->parameters()[f->a];
      const Parameter& b = adapter_->parameters()[f->b];
      const double p = adapter_->lora_config().dropout;
      at::Tensor xin = (p > 0 && options_.training) ? Dropout(x, p) : x;
      at::Tensor h = Linear(xin, a.value, a.main_grad, options_.grad);
      y = y + Linear(h, b.value, b.main_grad, options_.grad) * adapter_->lora_config().scale();
    }
    return y;
  }

  // Inverted dropout with the run's own generator (at::dropout would use the global one,
  // which runs sharing a process would perturb for each other).
  at::Tensor Dropout(const at::Tensor& x, double p) const {
    at::Tensor keep = at::empty(x.sizes(), at::kFloat);
    if (options_.dropout_generator != nullptr) {
      keep.bernoulli_(1.0 - p, *options_.dropout_generator);
    } else {
      keep.bernoulli_(1.0 - p);
    }
    return x * (keep.to(x.options()) / (1.0 - p));
  }

  at::Tensor Layer(size_t i, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) const {
    const LayerWeights& lw = weights_.layers[i];
    const ModelShard* shard = options_.shard;
    CommGroup* tp = options_.tensor_group;
    // Heads of this tensor rank (all of them without tensor parallelism).
    const int64_t b = x.size(0), s = x.size(1), d = c_.head_dim(),
                  nh = shard != nullptr ? shard->heads : c_.num_attention_heads,
                  nkv = shard != nullptr ? shard->kv_heads : c_.num_key_value_heads;
    at::Tensor h = CopyToTensorRegion(RmsNorm(x, lw.input_norm, c_.rms_norm_eps), tp);
    at::Tensor q = Project(i, kQProj, h).view({b, s, nh, d});
    at::Tensor k = Project(i, kKProj, h).view({b, s, nkv, d});
    if (lw.layout.qk_norm) {  // Qwen3: RMSNorm over each head, before RoPE
      q = RmsNorm(q, lw.q_norm, c_.rms_norm_eps);
      k = RmsNorm(k, lw.k_norm, c_.rms_norm_eps);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    at::Tensor v = Project(i, kVProj, h).view({b, s, nkv, d}).transpose(1, 2);
    int64_t kv_used = nkv;
    if (shard != nullptr && shard->kv_select >= 0) {  // replicated KV heads: the one we read
      k = k.narrow(1, shard->kv_select, 1);
      v = v.narrow(1, shard->kv_select, 1);
      kv_used = 1;
    }
    q = q * cos + RotateHalf(q) * sin;
    k = k * cos + RotateHalf(k) * sin;
    if (kv_used != nh) {  // grouped-query attention: each K/V head serves nh/kv query heads
      k = k.repeat_interleave(nh / kv_used, 1);
      v = v.repeat_interleave(nh / kv_used, 1);
    }
    at::Tensor attn = compat::CausalAttention(q, k, v).transpose(1, 2).reshape({b, s, nh * d});
    // Row-parallel o/down give partial sums (LoRA's B(A_i x_i) included): one all-reduce each.
    x = x + ReduceFromTensorRegion(Project(i, kOProj, attn), tp);
    h = CopyToTensorRegion(RmsNorm(x, lw.post_attention_norm, c_.rms_norm_eps), tp);
    if (lw.layout.moe) return x + MoeMlp(i, h);
    at::Tensor act = at::silu(Project(i, kGateProj, h)) * Project(i, kUpProj, h);
    return x + ReduceFromTensorRegion(Project(i, kDownProj, act), tp);
  }

  // Routed experts (transformers' Qwen2-MoE / Qwen3-MoE block): router softmax in fp32,
  // top-k, optional renormalization; tokens grouped by expert; each expert's gate/up and
  // down are frozen linears (one 2-D GEMM each way); weighted outputs added back per token.
  // Qwen2-MoE adds its shared expert, gated by sigmoid(x . w).
  at::Tensor MoeMlp(size_t i, const at::Tensor& h) const {
    const LayerWeights& lw = weights_.layers[i];
    const int64_t hidden = h.size(-1), top_k = c_.moe.num_experts_per_tok;
    at::Tensor x = h.reshape({-1, hidden});
    at::Tensor logits = Linear(x, lw.router, at::Tensor(), options_.grad);
    at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
    auto [top_p, top_e] = probs.topk(top_k, -1);
    if (c_.moe.norm_topk_prob) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
    top_p = top_p.to(logits.scalar_type());
    // Group the (token, slot) pairs by expert: one sort, then one contiguous run each.
    at::Tensor flat_e = top_e.reshape({-1});
    at::Tensor order = std::get<1>(flat_e.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    at::Tensor counts = at::bincount(flat_e, {}, c_.moe.num_experts).to(at::kCPU);
    if (options_.routing_metrics != nullptr) {
      const double hit = (counts > 0).sum().item<double>();
      const double mean = counts.to(at::kDouble).mean().item<double>();
      options_.routing_metrics->Add("moe_experts_hit:mean", hit / c_.moe.num_experts, 1.0);
      options_.routing_metrics->Add("moe_load_max_over_mean:max",
                                    mean > 0 ? counts.max().item<double>() / mean : 0.0);
    }
    at::Tensor out = at::zeros_like(x);
    const int64_t f = lw.experts_down.size(2);
    int64_t start = 0;
    for (int64_t e = 0; e < c_.moe.num_experts; ++e) {
      const int64_t n = counts[e].item<int64_t>();
      if (n == 0) continue;
      at::Tensor pairs = order.narrow(0, start, n);  // indices into [T * top_k]
      start += n;
      at::Tensor tokens = at::floor_divide(pairs, top_k);
      at::Tensor xs = x.index_select(0, tokens);
      at::Tensor gate_up = Linear(xs, lw.experts_gate_up[e], at::Tensor(), options_.grad);
      at::Tensor act = at::silu(gate_up.narrow(-1, 0, f)) * gate_up.narrow(-1, f, f);
      at::Tensor y = Linear(act, lw.experts_down[e], at::Tensor(), options_.grad);
      y = y * top_p.reshape({-1}).index_select(0, pairs).unsqueeze(1);
      out = out.index_add(0, tokens, y);
    }
    if (lw.layout.shared_expert_gate) {
      at::Tensor act = at::silu(Project(i, kGateProj, x)) * Project(i, kUpProj, x);
      at::Tensor shared = Project(i, kDownProj, act);
      out = out + at::sigmoid(Linear(x, lw.shared_expert_gate, at::Tensor(), options_.grad)) * shared;
    }
    return out.view(h.sizes());
  }

 private:
  const ModelConfig& c_;
  const ModelWeights& weights_;
  const ModelWeights* main_grads_;
  const Adapter* adapter_;
  const ForwardOptions& options_;
};

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

const at::Tensor& OutputWeight(const ModelWeights& base, const Adapter* adapter) {
  if (adapter != nullptr && adapter->full_finetune()) return adapter->full_weights().output_weight();
  return base.output_weight();
}

at::Tensor OutputMainGrad(const Adapter* adapter) {
  if (adapter != nullptr && adapter->full_finetune()) return adapter->full_main_grads().output_weight();
  return at::Tensor();
}

namespace {

const ModelWeights& WeightsFor(const ModelWeights& base, const Adapter* adapter) {
  return adapter != nullptr && adapter->full_finetune() ? adapter->full_weights() : base;
}

}  // namespace

at::Tensor Qwen2Embed(const ModelConfig&, const ModelWeights& base, const Adapter* adapter,
                      const at::Tensor& tokens, const ForwardOptions& options) {
  const ModelWeights& weights = WeightsFor(base, adapter);
  return options.shard != nullptr
             ? VocabParallelEmbedding(weights.embed_tokens, tokens, options.shard->vocab_begin,
                                      options.tensor_group)
             : at::embedding(weights.embed_tokens, tokens);
}

at::Tensor Qwen2Layers(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                       at::Tensor x, const ForwardOptions& options) {
  const bool full = adapter != nullptr && adapter->full_finetune();
  const ModelWeights& weights = WeightsFor(base, adapter);
  const ModelWeights* main_grads = full ? &adapter->full_main_grads() : nullptr;
  auto [cos, sin] = RopeTables(config, x.size(1), x.options());
  LayerRunner runner(config, weights, main_grads, full ? nullptr : adapter, options);
  for (size_t i = 0; i < weights.layers.size(); ++i) x = runner.Layer(i, x, cos, sin);
  return x;
}

at::Tensor Qwen2FinalNorm(const ModelConfig& config, const ModelWeights& base,
                          const Adapter* adapter, const at::Tensor& x) {
  return RmsNorm(x, WeightsFor(base, adapter).final_norm, config.rms_norm_eps);
}

at::Tensor Qwen2Hidden(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                       const at::Tensor& tokens, const ForwardOptions& options) {
  at::Tensor x = Qwen2Embed(config, base, adapter, tokens, options);
  x = Qwen2Layers(config, base, adapter, x, options);
  return Qwen2FinalNorm(config, base, adapter, x);
}

}  // namespace lorastep
