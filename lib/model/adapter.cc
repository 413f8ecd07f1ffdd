#include "lib/model/adapter.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

std::array<int64_t, 2> LinearShape(const ModelConfig& c, int slot) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim(),
                kv = c.num_key_value_heads * c.head_dim(), f = c.intermediate_size;
  switch (slot) {
    case kQProj: return {c.gated_attention() ? 2 * q : q, h};
    case kOProj: return {h, q};
    case kKProj: case kVProj: return {kv, h};
    case kGateProj: case kUpProj: return {f, h};
    case kDownProj: return {h, f};
    case kOutProj: return {h, c.LinearAttentionWidth(slot)};
    default: return {c.LinearAttentionWidth(slot), h};  // Gated DeltaNet's input projections
  }
}

}  // namespace

std::string Adapter::PeftKey(size_t layer, int slot, bool is_b) {
  return absl::StrCat("base_model.model.model.layers.", layer, ".", LinearSlotModulePath(slot),
                      is_b ? ".lora_B.weight" : ".lora_A.weight");
}

std::string Adapter::PeftHeadKey(bool is_b) {
  return is_b ? "base_model.model.lm_head.lora_B.weight" : "base_model.model.lm_head.lora_A.weight";
}

absl::StatusOr<Adapter> Adapter::CreateLora(const ModelConfig& model, const LoraConfig& lora,
                                            const at::Device& device, at::ScalarType dtype,
                                            uint64_t seed, const ModelShard* shard) {
  LORASTEP_RETURN_IF_ERROR(ValidateLoraConfig(lora));
  if (lora.full_finetune()) {
    return absl::InvalidArgumentError("lora.rank: 0 means full fine-tuning, not LoRA");
  }
  LORASTEP_ASSIGN_OR_RETURN(auto targeted, ResolveLoraTargets(lora));
  if (!model.HasLinearAttention()) {
    for (size_t i = 0; i < lora.target_modules.size(); ++i) {
      for (int slot = kInProjQkv; slot < kNumLinearSlots; ++slot) {
        if (lora.target_modules[i] == LinearSlotName(slot)) {
          return absl::InvalidArgumentError(absl::StrCat("lora.target_modules[", i, "]: ", LinearSlotName(slot),
                                                         " is a linear-attention projection; ", model.model_type,
                                                         " has none"));
        }
      }
    }
  }
  if (model.is_moe() && targeted[kGateProj] != targeted[kUpProj]) {
    return absl::InvalidArgumentError(
        "lora.target_modules: on a MoE model gate_proj and up_proj go together (the "
        "experts' fused fc1)");
  }
  Adapter adapter;
  adapter.lora_ = lora;
  const ModelShard whole = MakeModelShard({}, {}, model);
  const ModelShard& s = shard != nullptr ? *shard : whole;
  adapter.lora_by_layer_.resize(s.layer_end - s.layer_begin);
  adapter.expert_lora_by_layer_.resize(s.layer_end - s.layer_begin);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto add = [&](Parameter p, at::Tensor value) {
    p.value = value.contiguous().to(device, dtype);
    adapter.parameters_.push_back(std::move(p));
    return static_cast<int>(adapter.parameters_.size()) - 1;
  };
  for (int64_t layer = 0; layer < model.num_hidden_layers; ++layer) {
    const bool moe_layer = model.IsMoeLayer(layer);
    const bool mine = layer >= s.layer_begin && layer < s.layer_end;
    const LayerLayout layout = LayoutOfLayer(model, layer);
    for (int slot = 0; slot < kNumLinearSlots; ++slot) {
      if (!targeted[slot] || !layout.HasLinear(slot)) continue;
      // On a MoE layer gate/up/down mean the routed experts (below); the shared expert of
      // Qwen2-MoE gets no adapter.
      if (moe_layer && IsMlpSlot(slot)) continue;
      const auto [out, in] = LinearShape(model, slot);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      // Drawn for every layer so each rank's stream matches world size 1.
      at::Tensor a = at::empty({lora.rank, in}, at::kFloat).uniform_(-bound, bound, gen);
      at::Tensor b = at::zeros({out, lora.rank}, at::kFloat);
      if (!mine) continue;
      const LinearSplit split = LinearSplitOf(s, slot, model);
      Parameter pa{PeftKey(layer, slot, false), {}, {}};
      Parameter pb{PeftKey(layer, slot, true), {}, {}};
      pa.layer = pb.layer = layer;
      if (IsColumnParallel(slot)) {  // y_i = W_i x + s B_i (A x)
        b = CutLinearSplit(b, split, s.tp, s.tp_rank);
        pa.role = kReplicatedPartial;
        pb.split_dim = 0;
        pb.split_groups = split.groups;
        // k/v held whole on every tensor rank (tp > KV heads): B too, with partial gradients.
        if (split.replicated) pb.role = kReplicatedPartial;
      } else {  // y = sum_i (W_i x_i + s B (A_i x_i))
        a = a.narrow(1, split.begin, split.end - split.begin);
        pa.split_dim = 1;
        pb.role = kReplicatedPartial;
      }
      LoraFactors& f = adapter.lora_by_layer_[layer - s.layer_begin][slot];
      f.a = add(std::move(pa), a);
      f.b = add(std::move(pb), b);
    }
    if (!moe_layer) continue;
    LORASTEP_RETURN_IF_ERROR(adapter.AddExpertLora(model, s, layer, targeted[kGateProj],
                                                   targeted[kDownProj], gen, add));
  }
  if (LoraTargetsHead(lora)) {  // drawn after every layer: the layers' streams do not move
    const double bound = 1.0 / std::sqrt(static_cast<double>(model.hidden_size));
    at::Tensor a = at::empty({lora.rank, model.hidden_size}, at::kFloat).uniform_(-bound, bound, gen);
    at::Tensor b = at::zeros({model.vocab_size, lora.rank}, at::kFloat);
    if (s.last_stage()) {
      Parameter pa{PeftHeadKey(false), {}, {}};
      Parameter pb{PeftHeadKey(true), {}, {}};
      pa.role = kReplicatedFull;
      pb.split_dim = 0;
      if (shard != nullptr) b = b.narrow(0, s.vocab_begin, s.vocab_end - s.vocab_begin);
      adapter.head_lora_.a = add(std::move(pa), a);
      adapter.head_lora_.b = add(std::move(pb), b);
    }
  }
  // Key order: the order of the shared factors' collectives on every rank.
  std::sort(adapter.shared_factors_.begin(), adapter.shared_factors_.end(),
            [](const SharedFactor& x, const SharedFactor& y) { return x.key < y.key; });
  adapter.PackValues();
  for (auto& p : adapter.parameters_) p.value.requires_grad_(true);
  adapter.PackMainGrads();
  return adapter;
}

absl::Status Adapter::AddExpertLora(
    const ModelConfig& model, const ModelShard& s, int64_t layer, bool fc1, bool fc2,
    at::Generator& gen, const std::function<int(Parameter, at::Tensor)>& add) {
  const int64_t e = model.moe.num_experts, r = lora_.rank, h = model.hidden_size,
                f = model.moe.moe_intermediate_size;
  const bool shared = lora_.shared_outer();
  const int64_t eb = s.expert_begin, en = s.expert_end - s.expert_begin;
  const int64_t fb = s.moe_ffn_begin, fn = s.moe_ffn_end - s.moe_ffn_begin;
  const bool mine = layer >= s.layer_begin && layer < s.layer_end;
  ExpertLoraFactors factors;
  // A factor of this layer's experts: the rank keeps its experts (dim 0 of a stacked
  // factor) and, of a tensor-split one, its columns of the expert width.
  auto make = [&](const char* fc, bool is_b, at::Tensor whole, int split_dim) {
    Parameter p{absl::StrCat("base_model.model.model.layers.", layer, ".mlp.experts.", fc,
                             is_b ? ".lora_B.weight" : ".lora_A.weight"),
                {}, {}};
    p.layer = layer;
    p.family = fc;
    at::Tensor local = whole;
    if (whole.dim() == 2) {  // shared by every expert of the layer
      p.role = kSharedExpert;
      shared_factors_.push_back(SharedFactor{absl::StrCat("layers.", layer, ".experts.", fc,
                                                          is_b ? ".lora_B" : ".lora_A"),
                                             static_cast<int>(parameters_.size()), layer, fc,
                                             std::vector<int64_t>(whole.sizes().begin(), whole.sizes().end())});
    } else {
      p.expert_split = true;
      local = local.narrow(0, eb, en);
      if (split_dim >= 0) {
        p.role = kExpertSplit;
        p.split_dim = split_dim;
        local = local.narrow(split_dim, fb, fn);
      } else {
        p.role = kExpertReplicatedPartial;
      }
    }
    return add(std::move(p), local);
  };
  if (fc1) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(h));
    at::Tensor a = shared ? at::empty({r, h}, at::kFloat) : at::empty({e, r, h}, at::kFloat);
    a.uniform_(-bound, bound, gen);
    if (mine) {
      factors.fc1_a = make("fc1", false, a, -1);
      factors.fc1_b = make("fc1", true, at::zeros({e, 2, f, r}, at::kFloat), 2);
    }
  }
  if (fc2) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(f));
    at::Tensor a = at::empty({e, r, f}, at::kFloat).uniform_(-bound, bound, gen);
    if (mine) {
      factors.fc2_a = make("fc2", false, a, 2);
      factors.fc2_b = make("fc2", true, shared ? at::zeros({h, r}, at::kFloat) : at::zeros({e, h, r}, at::kFloat), -1);
    }
  }
  if (mine) expert_lora_by_layer_[layer - s.layer_begin] = factors;
  return absl::OkStatus();
}

Adapter Adapter::CreateFullFinetune(const ModelWeights& base, const ModelShard* shard,
                                    bool tied_embeddings, const ModelConfig* config) {
  Adapter adapter;
  adapter.lora_.rank = 0;
  adapter.full_weights_ = base;
  adapter.full_main_grads_ = base;
  const bool first = shard == nullptr || shard->first_stage();
  const bool last = shard == nullptr || shard->last_stage();
  const bool staged = shard != nullptr && shard->pp > 1;
  // Which named tensors this stage uses, hence trains.
  auto used = [&](const std::string& name) {
    if (name == "model.embed_tokens.weight") return first || (last && tied_embeddings);
    if (name == "model.norm.weight" || name == "lm_head.weight") return last;
    return true;
  };
  std::vector<at::Tensor*> trained_slots;
  ForEachNamedTensor(adapter.full_weights_, [&](const std::string& name, at::Tensor& t) {
    if (!used(name)) return;  // left as the frozen base tensor
    t = t.detach().clone().requires_grad_(true);
    Parameter p{name, t, {}};
    const bool kv = absl::StrContains(name, "k_proj.") || absl::StrContains(name, "v_proj.");
    const bool per_head_norm = absl::EndsWith(name, "q_norm.weight") || absl::EndsWith(name, "k_norm.weight") ||
                               absl::EndsWith(name, "linear_attn.norm.weight");
    if (per_head_norm) {
      p.role = kReplicatedPartial;  // applied to each of this rank's heads: part of the gradient
    } else if (absl::EndsWith(name, "norm.weight")) {
      p.role = kReplicatedFull;  // same input and upstream gradient on every tensor rank
    } else if (kv && shard != nullptr && shard->kv_replicated) {
      p.role = kReplicatedPartial;  // whole k/v on every rank; each uses one head's part
    } else {
      const bool row_parallel = absl::StrContains(name, "o_proj.weight") ||
                                absl::StrContains(name, "down_proj.weight") ||
                                absl::StrContains(name, "linear_attn.out_proj.weight");
      p.split_dim = row_parallel ? 1 : 0;
      // in_proj_qkv's rows and the convolution's channels: q, k and v each cut per rank.
      if (config != nullptr && (absl::StrContains(name, "linear_attn.in_proj_qkv.weight") ||
                                absl::StrContains(name, "linear_attn.conv1d.weight"))) {
        const LinearAttentionConfig& la = config->linear_attention;
        p.split_groups = {la.key_dim(), la.key_dim(), la.value_dim()};
      }
    }
    if (staged && tied_embeddings && name == "model.embed_tokens.weight") {
      p.tied_across_stages = true;
      p.stage_copy = !first;  // the last stage's copy of the first stage's embedding
    }
    adapter.parameters_.push_back(std::move(p));
  });
  adapter.PackMainGrads();
  // Mirror each trained parameter's main_grad into the model-shaped struct (same order);
  // tensors this stage does not train keep no main_grad.
  size_t i = 0;
  ForEachNamedTensor(adapter.full_main_grads_, [&](const std::string& name, at::Tensor& t) {
    t = used(name) ? adapter.parameters_[i++].main_grad : at::Tensor();
  });
  return adapter;
}

const ExpertLoraFactors* Adapter::expert_lora(size_t layer) const {
  if (layer >= expert_lora_by_layer_.size()) return nullptr;
  const ExpertLoraFactors& f = expert_lora_by_layer_[layer];
  return f.fc1_a < 0 && f.fc2_a < 0 ? nullptr : &f;
}

const LoraFactors* Adapter::lora(size_t layer, int slot) const {
  if (layer >= lora_by_layer_.size()) return nullptr;
  const LoraFactors& f = lora_by_layer_[layer][slot];
  return f.a < 0 ? nullptr : &f;
}

std::vector<int> Adapter::BucketOrder() const {
  std::vector<int> order;
  for (int bucket = 0; bucket < kNumGradBuckets; ++bucket) {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i].role == bucket) order.push_back(static_cast<int>(i));
    }
  }
  return order;
}

void Adapter::PackValues() {
  if (parameters_.empty()) return;
  int64_t total = 0;
  for (const Parameter& p : parameters_) total += p.value.numel();
  packed_values_ = at::empty({total}, parameters_.front().value.options().requires_grad(false));
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (int i : BucketOrder()) {
    Parameter& p = parameters_[i];
    // A plain tensor over the buffer's storage (not an autograd view): a leaf that shares the
    // buffer's version counter, so writes through the buffer invalidate what caches it.
    at::Tensor view = packed_values_.narrow(0, offset, p.value.numel()).view(p.value.sizes()).detach();
    view.copy_(p.value);
    p.value = view;
    offset += p.value.numel();
  }
}

void Adapter::PackMainGrads() {
  reductions_.assign(parameters_.size(), 0);
  for (auto& bucket : grad_buckets_) bucket = at::Tensor();
  std::array<int64_t, kNumGradBuckets> totals{};
  for (const Parameter& p : parameters_) totals[p.role] += p.value.numel();
  std::array<int64_t, kNumGradBuckets> offsets{};
  for (int i : BucketOrder()) {
    Parameter& p = parameters_[i];
    at::Tensor& bucket = grad_buckets_[p.role];
    if (!bucket.defined()) bucket = at::zeros({totals[p.role]}, p.value.options().dtype(at::kFloat).requires_grad(false));
    p.main_grad = bucket.narrow(0, offsets[p.role], p.value.numel()).view(p.value.sizes());
    offsets[p.role] += p.value.numel();
  }
}

void Adapter::ZeroMainGrads() {
  reductions_.assign(parameters_.size(), 0);
  for (at::Tensor& bucket : grad_buckets_) {
    if (bucket.defined()) bucket.zero_();
  }
  for (auto& p : parameters_) {
    if (p.value.grad().defined()) p.value.mutable_grad() = at::Tensor();
  }
}

}  // namespace lorastep
