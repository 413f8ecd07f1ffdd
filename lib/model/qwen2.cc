#include "lib/model/qwen2.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "lib/model/attention_paths.h"
#include "lib/model/gated_delta.h"
#include "lib/model/rope.h"
#include "lib/parallel/context_parallel.h"
#include "lib/torch_compat.h"

namespace lorastep {
namespace {

// A norm's weight as stored, or 1 + the stored offset (Qwen3.5's zero-centered RMSNorm).
at::Tensor NormWeightOf(const ModelConfig& c, const at::Tensor& w) { return c.zero_centered_norm() ? w + 1 : w; }

class LayerRunner {
 public:
  LayerRunner(const ModelConfig& c, const ModelWeights& weights, const ModelWeights* main_grads,
              const Adapter* adapter, const ForwardOptions& options, KeptAttention* kept_attention = nullptr)
      : c_(c), weights_(weights), main_grads_(main_grads), adapter_(adapter), options_(options),
        kept_attention_(kept_attention) {}

  // The LoRA factors of (layer, slot) when its branch runs inside one function with the
  // frozen base (LoraLinear): a frozen base and no dropout in training; else null.
  const LoraFactors* FusedLora(size_t layer, int slot) const {
    const LoraFactors* f = adapter_ != nullptr ? adapter_->lora(layer, slot) : nullptr;
    if (f == nullptr || main_grads_ != nullptr) return nullptr;
    return adapter_->lora_config().dropout > 0 && options_.training ? nullptr : f;
  }

  // The run segments' factors of (layer, slot) for SegmentedLoraLinear: a frozen base, fused
  // weight gradients, and no segment with a branch here using dropout in training; else nullopt.
  std::optional<std::vector<LoraSegment>> FusedSegments(size_t layer, int slot) const {
    if (main_grads_ != nullptr || !options_.grad.fused_wgrad) return std::nullopt;
    std::vector<LoraSegment> out;
    for (const RunSegment& seg : *options_.run_segments) {
      const LoraFactors* f = seg.adapter != nullptr ? seg.adapter->lora(layer, slot) : nullptr;
      if (f == nullptr) continue;
      if (seg.adapter->lora_config().dropout > 0 && options_.training) return std::nullopt;
      const Parameter& a = seg.adapter->parameters()[f->a];
      const Parameter& b = seg.adapter->parameters()[f->b];
      out.push_back({seg.begin, seg.end, a.value, a.main_grad, b.value, b.main_grad, seg.adapter->lora_config().scale()});
    }
    return out;
  }

  // Each run segment's LoRA branch of (layer, slot) over its rows of x [1, T, in], as one
  // [1, T, out] delta (zero on rows whose run has no branch there); undefined where no run has one.
  at::Tensor SegmentBranches(size_t layer, int slot, const at::Tensor& x, int64_t out) const {
    std::vector<at::Tensor> deltas;
    bool any = false;
    for (const RunSegment& seg : *options_.run_segments) {
      const at::Tensor xs = x.narrow(1, seg.begin, seg.end - seg.begin);
      const LoraFactors* f = seg.adapter != nullptr ? seg.adapter->lora(layer, slot) : nullptr;
      if (f == nullptr) {
        deltas.push_back(at::zeros({1, seg.end - seg.begin, out}, x.options()));
        continue;
      }
      any = true;
      const Parameter& a = seg.adapter->parameters()[f->a];
      const Parameter& b = seg.adapter->parameters()[f->b];
      const double p = seg.adapter->lora_config().dropout;
      const at::Tensor xin = p > 0 && options_.training ? LoraDropout(xs, p, seg.dropout_generator) : xs;
      const at::Tensor h = Linear(xin, a.value, a.main_grad, options_.grad);
      deltas.push_back(Linear(h, b.value, b.main_grad, options_.grad) * seg.adapter->lora_config().scale());
    }
    return any ? at::cat(deltas, 1) : at::Tensor();
  }

  // One linear of layer `layer`: frozen or trainable base, plus the LoRA branch if any.
  at::Tensor Project(size_t layer, int slot, const at::Tensor& x) const {
    const at::Tensor& w = weights_.layers[layer].linear[slot];
    at::Tensor mg = main_grads_ != nullptr ? main_grads_->layers[layer].linear[slot] : at::Tensor();
    const at::Tensor bias = slot < 3 ? weights_.layers[layer].qkv_bias[slot] : at::Tensor();
    if (options_.run_segments != nullptr) {  // several runs: the frozen base once, each run's branch on its rows
      if (std::optional<std::vector<LoraSegment>> segments = FusedSegments(layer, slot)) {
        return SegmentedLoraLinear(x, w, bias, *std::move(segments));
      }
      at::Tensor y = Linear(x, w, mg, options_.grad);
      if (bias.defined()) y = y + bias;
      const at::Tensor delta = SegmentBranches(layer, slot, x, w.size(0));
      return delta.defined() ? y + delta : y;
    }
    if (const LoraFactors* f = FusedLora(layer, slot)) {  // the common case, fused
      const Parameter& a = adapter_->parameters()[f->a];
      const Parameter& b = adapter_->parameters()[f->b];
      return LoraLinear(x, w, bias, a.value, a.main_grad, b.value, b.main_grad,
                        adapter_->lora_config().scale(), options_.grad);
    }
    at::Tensor y = Linear(x, w, mg, options_.grad);
    if (bias.defined()) y = y + bias;
    const double p = adapter_ != nullptr ? adapter_->lora_config().dropout : 0.0;
    if (const LoraFactors* f = adapter_ != nullptr ? adapter_->lora(layer, slot) : nullptr) {
      const Parameter& a = adapter_->parameters()[f->a];
      const Parameter& b = adapter_->parameters()[f->b];
      at::Tensor xin = (p > 0 && options_.training) ? Dropout(x, p) : x;
      at::Tensor h = Linear(xin, a.value, a.main_grad, options_.grad);
      y = y + Linear(h, b.value, b.main_grad, options_.grad) * adapter_->lora_config().scale();
    }
    return y;
  }

  // The projections `slots` of a layer over the same input as one LoraLinearGroup's operands:
  // their frozen weights packed back to back (PackProjections), each LoRA branch added into
  // its own columns. On a joint row (run_segments) the same packing with each run's branches
  // of these projections as one segment (`joint`, SegmentedLoraLinear). nullopt where they
  // run one by one: full fine-tuning, LoRA dropout in training on a branch of the group,
  // weights not back to back.
  struct PackedGroup {
    at::Tensor weight, bias;
    std::vector<LoraGroupPart> parts;
    bool joint = false;
    std::vector<LoraSegment> segments;  // joint: the runs with a branch in the group
  };
  std::optional<PackedGroup> GroupOf(size_t layer, std::initializer_list<int> slots) const {
    const double p = adapter_ != nullptr ? adapter_->lora_config().dropout : 0.0;
    if (main_grads_ != nullptr) return std::nullopt;
    if (p > 0 && options_.training &&
        std::any_of(slots.begin(), slots.end(), [&](int slot) { return adapter_->lora(layer, slot) != nullptr; })) {
      return std::nullopt;
    }
    PackedGroup group;
    if (options_.run_segments != nullptr) {
      std::optional<std::vector<LoraSegment>> segments = GroupSegmentsOf(layer, slots);
      if (!segments) return std::nullopt;
      group.joint = true;
      group.segments = *std::move(segments);
    }
    const LayerWeights& lw = weights_.layers[layer];
    std::vector<at::Tensor> ws, biases;
    for (int slot : slots) {
      ws.push_back(lw.linear[slot]);
      if (slot < 3 && lw.qkv_bias[slot].defined()) biases.push_back(lw.qkv_bias[slot]);
      LoraGroupPart part;
      part.width = lw.linear[slot].size(0);
      if (group.joint) continue;
      if (const LoraFactors* f = adapter_ != nullptr ? adapter_->lora(layer, slot) : nullptr) {
        const Parameter& a = adapter_->parameters()[f->a];
        const Parameter& b = adapter_->parameters()[f->b];
        part.a = a.value, part.a_main_grad = a.main_grad, part.b = b.value, part.b_main_grad = b.main_grad;
      }
      group.parts.push_back(std::move(part));
    }
    group.weight = AdjacentRows(ws);
    group.bias = biases.empty() ? at::Tensor() : AdjacentRows(biases);
    if (!group.weight.defined() || (!biases.empty() && (biases.size() != ws.size() || !group.bias.defined()))) {
      return std::nullopt;
    }
    return group;
  }

  // Each run segment's LoRA factors of the projections `slots` (packed in that order) as one
  // LoraSegment with a part per projection it has a branch on; runs without any are left out
  // (their rows get the base alone). nullopt where FusedSegments would be for any slot.
  std::optional<std::vector<LoraSegment>> GroupSegmentsOf(size_t layer, std::initializer_list<int> slots) const {
    std::vector<LoraSegment> out;
    for (const RunSegment& seg : *options_.run_segments) out.push_back({seg.begin, seg.end});
    int64_t column = 0;
    for (int slot : slots) {
      std::optional<std::vector<LoraSegment>> one = FusedSegments(layer, slot);
      if (!one) return std::nullopt;
      const int64_t width = weights_.layers[layer].linear[slot].size(0);
      for (const LoraSegment& s : *one) {  // FusedSegments keeps the run segments' order
        auto it = std::find_if(out.begin(), out.end(), [&](const LoraSegment& o) { return o.begin == s.begin; });
        it->scale = s.scale;
        it->parts.push_back({column, width, s.a, s.a_main_grad, s.b, s.b_main_grad});
      }
      column += width;
    }
    out.erase(std::remove_if(out.begin(), out.end(), [](const LoraSegment& s) { return s.parts.empty(); }), out.end());
    return out;
  }

  // The columns the norm before `group` leaves free after its output, so that the group's
  // fold writes x A^T there instead of copying x (GroupFoldRoom); 0 for none (and on a
  // joint row, whose runs' branches do not fold).
  int64_t FoldRoom(const std::optional<PackedGroup>& group) const {
    return group && !group->joint ? GroupFoldRoom(group->weight, group->parts, options_.grad) : 0;
  }

  // `group`'s output (GroupOf), undefined where there is none. `input_has_room`: x came
  // from a norm given FoldRoom(group).
  at::Tensor ProjectPacked(const std::optional<PackedGroup>& group, const at::Tensor& x, bool input_has_room) const {
    if (!group) return at::Tensor();
    if (group->joint) return SegmentedLoraLinear(x, group->weight, group->bias, group->segments);
    return LoraLinearGroup(x, group->weight, group->bias, group->parts,
                           adapter_ != nullptr ? adapter_->lora_config().scale() : 0.0, options_.grad,
                           options_.lora_operands, input_has_room);
  }

  // Causal attention of q [b, s, heads, d] over k/v [b, s, kv, d] -> [b, s, heads * d], as the
  // call's layout says (packed, context-parallel or padded). In a selectively recomputed
  // layer (kept_attention_) the no-grad forward keeps the result and the replay returns it
  // through KeptAttentionFunction. The packed layout's flash kernel and cuDNN's kernel on
  // padded rows (where SDPA picks it) keep their statistics, and backward runs from them;
  // elsewhere backward runs attention again.
  // `window` > 0: a sliding-window layer (ModelConfig::AttentionWindow): through the varlen
  // kernel's window on packed rows where it runs, else an explicit mask; `sinks` (this rank's
  // heads' sink logits, gpt-oss) where defined: on packed rows through the flash kernel's
  // log-sum-exp where UseSinkFlash says so, elsewhere through an explicit mask (context
  // parallelism's included).
  at::Tensor Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                    const at::Tensor& sinks) const {
    const int64_t b = q.size(0), s = q.size(1), width = q.size(2) * q.size(3);
    const PackedSequences* packed = options_.packed;
    const bool plain = window == 0 && !sinks.defined();
    AttentionFn attend = [packed, b, s, width, window, sinks](const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v) {
      if (packed == nullptr) {
        const at::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
        return CausalOrMasked(qt, kt, vt, window, sinks).transpose(1, 2).reshape({b, s, width});
      }
      return packed->context_group != nullptr ? ContextAttention(q, k, v, *packed, window, sinks)
                                              : PackedAttention(q, k, v, *packed, window, sinks);
    };
    KeptAttention* kept = kept_attention_;
    if (kept == nullptr) return attend(q, k, v);
    const bool replay = kept->out.defined();
    const auto kept_output = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      return KeptAttentionOutput(q, k, v, kept);
    };
    // Packed rows on the flash kernel keep its statistics (with frozen sinks under UseSinkFlash,
    // and the sink factor); other layers with sinks, and windowed ones off the varlen kernel,
    // keep none: their attention is replayed whole.
    const bool sink_flash = sinks.defined() && !sinks.requires_grad() && UseSinkFlash(q);
    if ((sink_flash || (!sinks.defined() && compat::HasVarlenAttention(q))) && packed != nullptr &&
        packed->context_group == nullptr) {
      const at::Tensor q0 = q[0], k0 = k[0], v0 = v[0].contiguous();
      if (!replay && sink_flash) {
        kept->kernel = KeptAttention::Kernel::kSinkFlash;
        kept->sink = SinkAttentionForward(q0, k0, v0, sinks,
                                          VarlenFlashLseKernel(packed->cu_seqlens, packed->max_length, window));
        kept->out = kept->sink.out;
      } else if (!replay) {
        kept->kernel = KeptAttention::Kernel::kFlash;
        kept->cu_seqlens = packed->cu_seqlens, kept->max_length = packed->max_length;
        kept->flash = compat::VarlenCausalAttentionSaved(q0, k0, v0, packed->cu_seqlens, packed->max_length, window);
        kept->out = kept->flash.out;
      }
      return (replay ? kept_output(q0, k0, v0) : kept->out).reshape({1, s, width});
    }
    if (plain && packed == nullptr) {
      const at::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = v.transpose(1, 2);
      if (replay ? kept->kernel == KeptAttention::Kernel::kCudnn : compat::UsesCudnnAttention(qt, kt, vt)) {
        if (!replay) {
          kept->kernel = KeptAttention::Kernel::kCudnn;
          kept->cudnn = compat::CudnnCausalAttentionSaved(qt, kt, vt);
          kept->out = kept->cudnn.out;
        }
        return (replay ? kept_output(qt, kt, vt) : kept->out).transpose(1, 2).reshape({b, s, width});
      }
    }
    if (!replay) return kept->out = attend(q, k, v);
    kept->attend = std::move(attend);
    return kept_output(q, k, v);
  }

  at::Tensor Dropout(const at::Tensor& x, double p) const { return LoraDropout(x, p, options_.dropout_generator); }

  // The down projection of SwiGLU(gate_up) for a packed gate_up. With a LoRA branch on
  // down_proj in the fused form, backward rebuilds the activation from gate_up instead of
  // keeping it (LoraLinearRecomputed with kSwiGluOfPacked): the same values, a third less
  // activation memory in a dense layer. A joint row does the same for every run's branch
  // (SegmentedLoraLinearRecomputed), so it keeps what the runs' activation estimate counts.
  at::Tensor DownOfPacked(size_t i, const at::Tensor& gate_up) const {
    if (options_.run_segments != nullptr && gate_up.is_contiguous()) {
      if (std::optional<std::vector<LoraSegment>> segments = FusedSegments(i, kDownProj)) {
        return SegmentedLoraLinearRecomputed(gate_up, kSwiGluOfPacked, weights_.layers[i].linear[kDownProj],
                                             /*bias=*/at::Tensor(), *std::move(segments));
      }
    }
    const LoraFactors* f = FusedLora(i, kDownProj);
    if (f != nullptr && options_.grad.fused_wgrad && gate_up.is_contiguous()) {
      const Parameter& a = adapter_->parameters()[f->a];
      const Parameter& b = adapter_->parameters()[f->b];
      return LoraLinearRecomputed(gate_up, kSwiGluOfPacked, weights_.layers[i].linear[kDownProj], /*bias=*/at::Tensor(), a.value,
                                  a.main_grad, b.value, b.main_grad, adapter_->lora_config().scale());
    }
    return Project(i, kDownProj, SwiGluPacked(gate_up));
  }

  // q, k (with RoPE) and v of layer i from the normed input h, each [b, s, heads, d].
  // `qkv_group`: GroupOf(i, q/k/v); `input_has_room`: h came from a norm given its FoldRoom.
  // Qwen3.5's gated attention also gives each head's output gate [b, s, heads * d] (else undefined).
  struct Qkv {
    at::Tensor q, k, v, gate;
  };
  Qkv QueryKeyValue(size_t i, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, int64_t nh,
                    int64_t nkv, const std::optional<PackedGroup>& qkv_group, bool input_has_room) const {
    const LayerWeights& lw = weights_.layers[i];
    const ModelShard* shard = options_.shard;
    const int64_t b = h.size(0), s = h.size(1), d = c_.head_dim();
    const int64_t qd = c_.gated_attention() ? 2 * d : d;  // each head's query (and gate) width
    at::Tensor q, k, v, gate;
    at::Tensor qkv = ProjectPacked(qkv_group, h, input_has_room);
#ifdef LORASTEP_WITH_CUDA_KERNELS
    const bool plain_heads = !lw.layout.qk_norm && !(shard != nullptr && shard->kv_select >= 0);
    if (qkv.defined() && plain_heads && UseFusedKernels(qkv, cos) && qkv.stride(-1) == 1) {
      auto out = QkvRope(qkv, cos, sin, nh, nkv);
      return {out[0], out[1], out[2], at::Tensor()};
    }
#endif
    if (qkv.defined()) {
      q = qkv.narrow(-1, 0, nh * qd).view({b, s, nh, qd});
      k = qkv.narrow(-1, nh * qd, nkv * d).view({b, s, nkv, d});
      v = qkv.narrow(-1, nh * qd + nkv * d, nkv * d).view({b, s, nkv, d});
    } else {
      q = Project(i, kQProj, h).view({b, s, nh, qd});
      k = Project(i, kKProj, h).view({b, s, nkv, d});
      v = Project(i, kVProj, h).view({b, s, nkv, d});
    }
    if (qd != d) {  // each head: its query, then its gate
      gate = q.narrow(-1, d, d).reshape({b, s, nh * d});
      q = q.narrow(-1, 0, d);
    }
    if (lw.layout.qk_norm) {  // Qwen3: RMSNorm over each head, before RoPE
      q = RmsNorm(q, NormWeight(lw.q_norm), c_.rms_norm_eps);
      k = RmsNorm(k, NormWeight(lw.k_norm), c_.rms_norm_eps);
    }
    if (shard != nullptr && shard->kv_select >= 0) {  // replicated KV heads: the one we read
      k = k.narrow(2, shard->kv_select, 1);
      v = v.narrow(2, shard->kv_select, 1);
    }
    // RoPE on the projections' own [b, s, heads, d] layout (partial: the first rotary_dim).
    const int64_t rd = cos.size(-1);
    auto rope = [&](const at::Tensor& t) {
      if (rd == d) return ApplyRope(t, cos, sin);
      return at::cat({ApplyRope(t.narrow(-1, 0, rd).contiguous(), cos, sin), t.narrow(-1, rd, d - rd)}, -1);
    };
    return {rope(q), rope(k), v, gate};
  }

  at::Tensor NormWeight(const at::Tensor& w) const { return NormWeightOf(c_, w); }

  // Qwen3.5's Gated DeltaNet over the normed input h [b, s, H] (GatedDeltaNetMix), its
  // projections through Project (LoRA included); each packed sequence from a zero state; on
  // context ranks the rule over the whole row gathered from the group.
  at::Tensor LinearAttention(size_t i, const at::Tensor& h) const {
    const LayerWeights& lw = weights_.layers[i];
    TORCH_CHECK(options_.cached_attention == nullptr || options_.recurrent_states != nullptr,
                "cached attention without the linear-attention layers' recurrent states");
    const PackedSequences* packed = options_.packed;
    std::optional<ContextRows> context;  // this rank holds part of the row: the rule sees it whole
    if (packed != nullptr && packed->context_group != nullptr) {
      context.emplace();
      context->whole = [packed](const at::Tensor& x) {
        return GatherContextRows(x[0], packed->context_group, packed->context_counts)
            .index_select(0, packed->context_order)
            .unsqueeze(0);
      };
      context->own = packed->context_tokens;
    }
    GatedDeltaWeights weights{lw.conv1d, lw.a_log, lw.dt_bias, lw.linear_norm};
    auto project = [&](int slot, const at::Tensor& x) { return Project(i, slot, x); };
    return GatedDeltaNetMix(LocalLinearAttention(c_, options_.shard), weights, project, h,
                            packed != nullptr ? packed->lengths : std::vector<int64_t>{}, c_.rms_norm_eps,
                            options_.recurrent_states, weights_.first_layer + static_cast<int64_t>(i),
                            context ? &*context : nullptr, options_.keep_linear_attention_rule);
  }

  // Layer i over x as a RecomputedLayerNode (activation recomputation): like Layer, with both
  // outputs attached to the node, which keeps only x. Defined after the node.
  std::pair<at::Tensor, at::Tensor> RecomputedLayer(size_t i, const at::Tensor& x, const at::Tensor& cos,
                                                    const at::Tensor& sin, LayerRecompute mode) const;

  // One decoder layer over the residual stream x, where `pending` is the previous layer's
  // MLP output not yet added to it (undefined before the first layer): each residual add
  // runs inside the next RMSNorm's node (AddRmsNorm). Returns the stream and this layer's
  // pending MLP output.
  std::pair<at::Tensor, at::Tensor> Layer(size_t i, at::Tensor x, const at::Tensor& pending, const at::Tensor& cos,
                                          const at::Tensor& sin) const {
    const LayerWeights& lw = weights_.layers[i];
    const ModelShard* shard = options_.shard;
    CommGroup* tp = options_.tensor_group;
    // Heads of this tensor rank (all of them without tensor parallelism).
    const int64_t nh = shard != nullptr ? shard->heads : c_.num_attention_heads,
                  nkv = shard != nullptr ? shard->kv_heads : c_.num_key_value_heads;
    at::Tensor h, attn_out;
    // Row-parallel o/down give partial sums (LoRA's B(A_i x_i) included): one all-reduce each.
    const std::optional<PackedGroup> mlp_group =
        lw.layout.moe ? std::nullopt : GroupOf(i, {kGateProj, kUpProj});
    const int64_t mlp_room = FoldRoom(mlp_group);
    if (lw.layout.linear_attention) {
      std::tie(x, h) = AddRmsNorm(x, pending, NormWeight(lw.input_norm), c_.rms_norm_eps, 0);
      // Heads split over the tensor ranks; out_proj is row-parallel: one all-reduce.
      attn_out = ReduceFromTensorRegion(LinearAttention(i, CopyToTensorRegion(h, tp)), tp);
    } else {
      // Each norm leaves room after its output for the next group's fold (FoldRoom).
      const std::optional<PackedGroup> qkv_group = GroupOf(i, {kQProj, kKProj, kVProj});
      const int64_t qkv_room = FoldRoom(qkv_group);
      std::tie(x, h) = AddRmsNorm(x, pending, NormWeight(lw.input_norm), c_.rms_norm_eps, qkv_room);
      auto [q, k, v, gate] = QueryKeyValue(i, CopyToTensorRegion(h, tp), cos, sin, nh, nkv, qkv_group, qkv_room > 0);
      const int64_t layer = weights_.first_layer + static_cast<int64_t>(i);
      at::Tensor attn = options_.cached_attention != nullptr
                            ? options_.cached_attention->Attend(layer, q, k, v, lw.sinks)
                            : Attend(q, k, v, c_.AttentionWindow(layer), lw.sinks);
      if (gate.defined()) attn = attn * at::sigmoid(gate);  // Qwen3.5's output gate
      attn_out = ReduceFromTensorRegion(Project(i, kOProj, attn), tp);
      if (lw.o_bias.defined()) attn_out = attn_out + lw.o_bias;  // once, after the tensor ranks' sum
    }
    std::tie(x, h) = AddRmsNorm(x, attn_out, NormWeight(lw.post_attention_norm), c_.rms_norm_eps, mlp_room);
    h = CopyToTensorRegion(h, tp);
    if (lw.layout.moe) return {x, MoeMlp(i, h)};
    at::Tensor gate_up = ProjectPacked(mlp_group, h, mlp_room > 0);
    at::Tensor down = gate_up.defined() ? DownOfPacked(i, gate_up)
                                        : Project(i, kDownProj, SwiGlu(Project(i, kGateProj, h), Project(i, kUpProj, h)));
    return {x, ReduceFromTensorRegion(down, tp)};
  }

  // Routed experts (transformers' Qwen2-MoE / Qwen3-MoE block): router softmax in fp32,
  // top-k, optional renormalization; the (token, slot) pairs grouped by expert; with expert
  // parallelism each pair goes to the rank holding its expert and comes back (all-to-all);
  // weighted outputs added back per token. Qwen2-MoE adds its shared expert, gated by
  // sigmoid(x . w). With tensor parallelism each rank computes its columns of every
  // expert's width, so outputs are partial sums: one all-reduce at the end.
  at::Tensor MoeMlp(size_t i, const at::Tensor& h) const {
    const LayerWeights& lw = weights_.layers[i];
    const int64_t hidden = h.size(-1), top_k = c_.moe.num_experts_per_tok, experts = c_.moe.num_experts;
    at::Tensor x = h.reshape({-1, hidden});
    at::Tensor logits = Linear(x, lw.router, at::Tensor(), options_.grad);
    if (lw.router_bias.defined()) logits = logits + lw.router_bias;
    // gpt-oss takes a softmax over the top-k logits: the same as the top-k of the softmax,
    // renormalized (norm_topk_prob), which is how it is configured here.
    at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
    auto [top_p, top_e] = probs.topk(top_k, -1);
    if (c_.moe.norm_topk_prob) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
    top_p = top_p.to(logits.scalar_type());
    // Group the (token, slot) pairs by expert: one stable sort, then one contiguous run each.
    at::Tensor flat_e = top_e.reshape({-1});
    at::Tensor order = std::get<1>(flat_e.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    at::Tensor counts = at::bincount(flat_e, {}, experts);
    // Kept on the device: the routing figures are computed once per call (RoutingMetrics).
    if (options_.routing_counts != nullptr) options_.routing_counts->push_back(counts);
    // Pair p = token * top_k + slot. Dispatch and combine are row permutations (gathers both
    // ways, no scatter-add); the top-k outputs of a token are summed with their weights.
    at::Tensor inverse = at::empty_like(order);
    inverse.index_copy_(0, order, at::arange(order.numel(), order.options()));
    at::Tensor pairs = x.unsqueeze(1).expand({x.size(0), top_k, hidden}).reshape({-1, hidden});
    at::Tensor rows = PermuteRows(pairs, order, inverse);  // [pairs, H], grouped by expert
    at::Tensor y = PermuteRows(ExchangeAndRunExperts(i, rows, counts), inverse, order);
    at::Tensor out = (y.view({x.size(0), top_k, hidden}) * top_p.unsqueeze(-1)).sum(1);
    if (lw.layout.shared_expert_gate) {
      at::Tensor act = SwiGlu(Project(i, kGateProj, x), Project(i, kUpProj, x));
      at::Tensor shared = Project(i, kDownProj, act);
      out = out + at::sigmoid(Linear(x, lw.shared_expert_gate, at::Tensor(), options_.grad)) * shared;
    }
    return ReduceFromTensorRegion(out, options_.tensor_group).view(h.sizes());
  }

  // Rows grouped by global expert id (counts[e] rows for expert e) through the experts: with
  // an expert group, sent to the ranks holding them, regrouped by local expert, computed,
  // and sent back into the caller's order.
  at::Tensor ExchangeAndRunExperts(size_t i, const at::Tensor& rows, const at::Tensor& counts) const {
    CommGroup* group = options_.expert_group;
    if (group == nullptr || group->size() == 1) return RunExperts(i, rows, counts);
    const at::Tensor counts_cpu = counts.to(at::kCPU);  // the split sizes are host values
    const int ep = group->size();
    const int64_t per_rank = c_.moe.num_experts / ep;
    // Tell every member how many rows of each of its experts are coming: recv[src][e_local].
    at::Tensor sent = counts.view({ep, per_rank});
    at::Tensor recv = AllToAllRows(sent, group, std::vector<int64_t>(ep, 1), std::vector<int64_t>(ep, 1)).to(at::kCPU);
    at::Tensor sent_cpu = counts_cpu.view({ep, per_rank});
    std::vector<int64_t> in_splits(ep), out_splits(ep);
    for (int j = 0; j < ep; ++j) {
      in_splits[j] = sent_cpu[j].sum().item<int64_t>();
      out_splits[j] = recv[j].sum().item<int64_t>();
    }
    at::Tensor received = AllToAllRows(rows, group, in_splits, out_splits);  // by source, then expert
    // Regroup by local expert (all sources' rows of expert 0, then expert 1, ...).
    const auto* r = recv.data_ptr<int64_t>();
    std::vector<int64_t> src_offset(ep, 0), perm, local_counts(per_rank, 0);
    for (int j = 1; j < ep; ++j) src_offset[j] = src_offset[j - 1] + out_splits[j - 1];
    for (int64_t e = 0; e < per_rank; ++e) {
      for (int j = 0; j < ep; ++j) {
        int64_t begin = src_offset[j];
        for (int64_t k = 0; k < e; ++k) begin += r[j * per_rank + k];
        for (int64_t n = 0; n < r[j * per_rank + e]; ++n) perm.push_back(begin + n);
        local_counts[e] += r[j * per_rank + e];
      }
    }
    at::Tensor perm_t = at::tensor(perm, at::kLong);
    at::Tensor inverse = at::empty_like(perm_t);
    if (perm_t.numel() > 0) inverse.index_copy_(0, perm_t, at::arange(perm_t.numel(), at::kLong));
    const at::Device device = rows.device();
    at::Tensor grouped = received.index_select(0, perm_t.to(device));
    at::Tensor y = RunExperts(i, grouped, at::tensor(local_counts, at::kLong)).index_select(0, inverse.to(device));
    return AllToAllRows(y, group, out_splits, in_splits);
  }

  // An expert's activation of its packed [gate | up] output: SwiGLU, or gpt-oss's clamped form.
  at::Tensor ExpertActivation(const at::Tensor& gate_up) const {
    if (!c_.clamped_swiglu()) return SwiGluPacked(gate_up);
    return ClampedSwiGluPacked(gate_up, c_.moe.swiglu_alpha, c_.moe.swiglu_limit);
  }

  // This rank's experts over rows grouped by local expert (counts[e] rows each, int64 on any
  // device): frozen gate/up and down plus expert LoRA when the adapter has it, as grouped
  // GEMMs (CUDA bf16: no host synchronization) or one 2-D GEMM each way per expert.
  // Shared-outer: fc1's shared A runs once over all rows and fc2's shared B once over all
  // experts' inner activations.
  at::Tensor RunExperts(size_t i, const at::Tensor& rows, const at::Tensor& counts_any) const {
    const LayerWeights& lw = weights_.layers[i];
    const int64_t f = lw.experts_down.size(2);
    if (rows.size(0) == 0) return rows.mul(0).narrow(1, 0, lw.experts_down.size(1));
    const ExpertLoraFactors* lf = adapter_ != nullptr ? adapter_->expert_lora(i) : nullptr;
    const Parameter* fc1_a = lf != nullptr && lf->fc1_a >= 0 ? &adapter_->parameters()[lf->fc1_a] : nullptr;
    const Parameter* fc1_b = lf != nullptr && lf->fc1_b >= 0 ? &adapter_->parameters()[lf->fc1_b] : nullptr;
    const Parameter* fc2_a = lf != nullptr && lf->fc2_a >= 0 ? &adapter_->parameters()[lf->fc2_a] : nullptr;
    const Parameter* fc2_b = lf != nullptr && lf->fc2_b >= 0 ? &adapter_->parameters()[lf->fc2_b] : nullptr;
    const double scale = adapter_ != nullptr ? adapter_->lora_config().scale() : 0.0;
    const double p = adapter_ != nullptr ? adapter_->lora_config().dropout : 0.0;
    auto lora_input = [&](const at::Tensor& t) { return (p > 0 && options_.training) ? Dropout(t, p) : t; };
    // The factor of local expert e (a stacked one) or the shared one.
    auto value = [](const Parameter* q, int64_t e) { return q->value.dim() == 2 ? q->value : q->value.select(0, e); };
    auto grad = [](const Parameter* q, int64_t e) {
      return q->main_grad.dim() == 2 ? q->main_grad : q->main_grad.select(0, e);
    };
    const bool shared_a = fc1_a != nullptr && fc1_a->value.dim() == 2;
    const bool shared_b = fc2_b != nullptr && fc2_b->value.dim() == 2;
    // gpt-oss's expert biases; down's is a full output, so only tensor rank 0 adds it (the
    // others' partial sums join it in the all-reduce).
    const at::Tensor& up_bias = lw.experts_gate_up_bias;
    const at::Tensor down_bias = options_.shard == nullptr || options_.shard->tp_rank == 0 ? lw.experts_down_bias
                                                                                          : at::Tensor();
    const int64_t rank = fc1_a != nullptr ? fc1_a->value.size(-2) : fc2_a != nullptr ? fc2_a->value.size(-2) : 8;
    if (options_.grouped_experts && GroupedLinearAvailable(rows, {rows.size(1), f, rank})) {
      // One grouped GEMM per projection over all experts (CUDA, bf16): no per-expert loop.
      at::Tensor offs = counts_any.to(rows.device()).cumsum(0).to(at::kInt);
      auto stacked = [](const Parameter* q) { return q->value.reshape({q->value.size(0), -1, q->value.size(-1)}); };
      auto stacked_grad = [](const Parameter* q) {
        return q->main_grad.reshape({q->main_grad.size(0), -1, q->main_grad.size(-1)});
      };
      at::Tensor gate_up = GroupedLinear(rows, lw.experts_gate_up, at::Tensor(), offs, options_.grad);
      at::Tensor row_expert;  // each row's local expert, for the biases
      if (up_bias.defined()) {
        const at::Tensor counts = counts_any.to(rows.device());
        row_expert = at::repeat_interleave(at::arange(counts.numel(), counts.options()), counts);
        gate_up = gate_up + up_bias.index_select(0, row_expert);
      }
      if (fc1_a != nullptr) {
        at::Tensor inner = shared_a ? Linear(lora_input(rows), fc1_a->value, fc1_a->main_grad, options_.grad)
                                    : GroupedLinear(lora_input(rows), fc1_a->value, fc1_a->main_grad, offs, options_.grad);
        gate_up = gate_up + GroupedLinear(inner, stacked(fc1_b), stacked_grad(fc1_b), offs, options_.grad) * scale;
      }
      at::Tensor act = ExpertActivation(gate_up);
      at::Tensor y = GroupedLinear(act, lw.experts_down, at::Tensor(), offs, options_.grad);
      if (down_bias.defined()) y = y + down_bias.index_select(0, row_expert);
      if (fc2_a != nullptr) {
        at::Tensor inner = GroupedLinear(lora_input(act), fc2_a->value, fc2_a->main_grad, offs, options_.grad);
        y = y + (shared_b ? Linear(inner, fc2_b->value, fc2_b->main_grad, options_.grad)
                          : GroupedLinear(inner, fc2_b->value, fc2_b->main_grad, offs, options_.grad)) * scale;
      }
      return y;
    }
    const at::Tensor counts_cpu = counts_any.to(at::kCPU);
    const std::vector<int64_t> counts(counts_cpu.data_ptr<int64_t>(), counts_cpu.data_ptr<int64_t>() + counts_cpu.numel());
    at::Tensor fc1_inner_all;
    if (shared_a) fc1_inner_all = Linear(lora_input(rows), fc1_a->value, fc1_a->main_grad, options_.grad);
    std::vector<at::Tensor> ys, fc2_inner;
    int64_t start = 0;
    for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      at::Tensor xs = rows.narrow(0, start, n);
      at::Tensor gate_up = Linear(xs, lw.experts_gate_up[e], at::Tensor(), options_.grad);
      if (up_bias.defined()) gate_up = gate_up + up_bias[e];
      if (fc1_a != nullptr) {
        at::Tensor inner = shared_a ? fc1_inner_all.narrow(0, start, n)
                                    : Linear(lora_input(xs), value(fc1_a, e), grad(fc1_a, e), options_.grad);
        const int64_t r = inner.size(1);
        gate_up = gate_up + Linear(inner, value(fc1_b, e).view({2 * f, r}), grad(fc1_b, e).view({2 * f, r}),
                                   options_.grad) * scale;
      }
      at::Tensor act = ExpertActivation(gate_up);
      at::Tensor y = Linear(act, lw.experts_down[e], at::Tensor(), options_.grad);
      if (down_bias.defined()) y = y + down_bias[e];
      if (fc2_a != nullptr) {
        at::Tensor inner = Linear(lora_input(act), value(fc2_a, e), grad(fc2_a, e), options_.grad);
        if (shared_b) {
          fc2_inner.push_back(inner);
        } else {
          y = y + Linear(inner, value(fc2_b, e), grad(fc2_b, e), options_.grad) * scale;
        }
      }
      ys.push_back(y);
      start += n;
    }
    at::Tensor y = at::cat(ys, 0);
    if (shared_b) y = y + Linear(at::cat(fc2_inner, 0), fc2_b->value, fc2_b->main_grad, options_.grad) * scale;
    return y;
  }

 private:
  const ModelConfig& c_;
  const ModelWeights& weights_;
  const ModelWeights* main_grads_;
  const Adapter* adapter_;
  const ForwardOptions& options_;
  KeptAttention* kept_attention_;  // selective recomputation: this layer's kept attention
};

// One decoder layer whose activations are not kept (activation recomputation): forward runs
// the layer without autograd and keeps only its input; backward runs it again with autograd
// from that input (the same kernels on the same values: the same results) and back-propagates
// through it, which accumulates the parameters' gradients as the plain forward would and
// returns the input's. LoRA dropout draws the same masks again (the generator is rewound for
// the replay and put back after), MoE routing is counted once (not in the replay), and a
// tensor or expert group's collectives run again in the replay in the same order on every
// rank. In selective recomputation the node also keeps the layer's attention (KeptAttention)
// and the replay does not run attention's forward. The node owns what the replay needs
// beyond the call's lifetime objects: its options and the packed-sequence layout.
class RecomputedLayerNode : public torch::autograd::Node {
 public:
  RecomputedLayerNode(const ModelConfig& c, const ModelWeights& weights, const ModelWeights* main_grads,
                      const Adapter* adapter, const ForwardOptions& options, size_t layer, at::Tensor input,
                      at::Tensor cos, at::Tensor sin, at::Tensor dropout_state, std::shared_ptr<KeptAttention> kept)
      : c_(c), weights_(weights), main_grads_(main_grads), adapter_(adapter), options_(options), layer_(layer),
        input_(std::move(input)), cos_(std::move(cos)), sin_(std::move(sin)), dropout_state_(std::move(dropout_state)),
        kept_(std::move(kept)) {
    options_.routing_counts = nullptr;
    if (options.packed != nullptr) {
      packed_ = *options.packed;
      options_.packed = &packed_;
    }
  }

  std::string name() const override { return "lorastep::RecomputedLayerNode"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x = input_.detach().requires_grad_(input_.requires_grad());
    at::Tensor resume_state;
    if (dropout_state_.defined()) {
      resume_state = options_.dropout_generator->get_state();
      options_.dropout_generator->set_state(dropout_state_);
    }
    std::pair<at::Tensor, at::Tensor> out;
    {
      at::AutoGradMode enable(true);
      out = LayerRunner(c_, weights_, main_grads_, adapter_, options_, kept_.get())
                .Layer(layer_, x, at::Tensor(), cos_, sin_);
    }
    if (resume_state.defined()) options_.dropout_generator->set_state(resume_state);
    torch::autograd::variable_list outputs, output_grads;
    for (const auto& [t, g] : {std::make_pair(out.first, grads[0]), std::make_pair(out.second, grads[1])}) {
      if (g.defined() && t.requires_grad()) outputs.push_back(t), output_grads.push_back(g);
    }
    if (!outputs.empty()) torch::autograd::backward(outputs, output_grads);
    return {x.requires_grad() ? x.grad() : at::Tensor()};
  }

  void release_variables() override { input_.reset(), cos_.reset(), sin_.reset(), kept_.reset(); }

 private:
  const ModelConfig& c_;
  const ModelWeights& weights_;
  const ModelWeights* main_grads_;
  const Adapter* adapter_;
  ForwardOptions options_;
  PackedSequences packed_;
  size_t layer_;
  at::Tensor input_, cos_, sin_, dropout_state_;
  std::shared_ptr<KeptAttention> kept_;  // selective recomputation only
};

std::pair<at::Tensor, at::Tensor> LayerRunner::RecomputedLayer(size_t i, const at::Tensor& x, const at::Tensor& cos,
                                                              const at::Tensor& sin, LayerRecompute mode) const {
  // The generator where this layer's forward starts drawing: the replay starts there too.
  at::Tensor dropout_state =
      options_.dropout_generator != nullptr ? options_.dropout_generator->get_state() : at::Tensor();
  auto kept = mode == LayerRecompute::kSelective ? std::make_shared<KeptAttention>() : nullptr;
  std::pair<at::Tensor, at::Tensor> out;
  {
    at::NoGradGuard no_grad;
    out = LayerRunner(c_, weights_, main_grads_, adapter_, options_, kept.get()).Layer(i, x, at::Tensor(), cos, sin);
  }
  auto node = std::shared_ptr<RecomputedLayerNode>(
      new RecomputedLayerNode(c_, weights_, main_grads_, adapter_, options_, i, x, cos, sin, std::move(dropout_state),
                              std::move(kept)),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(out.first, node);
  torch::autograd::set_history(out.second, node);
  return out;
}

}  // namespace

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
  auto [cos, sin] = RopeTables(config, options.packed != nullptr ? options.packed->max_length : x.size(1), x.options());
  if (options.packed != nullptr) {  // one row per token, at its position in its own sequence
    cos = cos.index_select(0, options.packed->positions);
    sin = sin.index_select(0, options.packed->positions);
  }
  if (options.run_segments != nullptr) {  // the contract of ForwardOptions::run_segments
    TORCH_CHECK(adapter == nullptr && options.packed != nullptr && options.recompute_layers == LayerRecompute::kNone,
                "run_segments: packed rows, no adapter of the call's own and no recomputation");
    int64_t next = 0;
    for (const RunSegment& seg : *options.run_segments) {
      TORCH_CHECK(seg.begin == next && seg.end > seg.begin, "run_segments: segments must cover the row in order");
      next = seg.end;
    }
    TORCH_CHECK(next == x.size(1), "run_segments: segments cover ", next, " of ", x.size(1), " rows");
    for (const LayerWeights& lw : weights.layers) TORCH_CHECK(!lw.layout.moe, "run_segments: dense layers only");
  }
  LayerRunner runner(config, weights, main_grads, full ? nullptr : adapter, options);
  at::Tensor pending;  // the last layer's MLP output, added after the loop
  const bool recompute = options.recompute_layers != LayerRecompute::kNone && at::GradMode::is_enabled();
  const std::function<bool()>* cancelled = options.cancelled;
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    if (cancelled != nullptr && (*cancelled)()) throw LayersCancelled();
    if (recompute) {  // keep one tensor per layer: its input, the stream with the last MLP added
      if (pending.defined()) x = x + pending;
      std::tie(x, pending) = runner.RecomputedLayer(i, x, cos, sin, options.recompute_layers);
    } else {
      std::tie(x, pending) = runner.Layer(i, x, pending, cos, sin);
    }
    if (cancelled != nullptr && x.requires_grad()) {  // asked again as backward passes this layer
      x.register_hook([cancelled](const at::Tensor&) {
        if ((*cancelled)()) throw LayersCancelled();
      });
    }
  }
  return pending.defined() ? x + pending : x;
}

at::Tensor Qwen2FinalNorm(const ModelConfig& config, const ModelWeights& base,
                          const Adapter* adapter, const at::Tensor& x) {
  return RmsNorm(x, NormWeightOf(config, WeightsFor(base, adapter).final_norm), config.rms_norm_eps);
}

at::Tensor Qwen2Hidden(const ModelConfig& config, const ModelWeights& base, const Adapter* adapter,
                       const at::Tensor& tokens, const ForwardOptions& options) {
  at::Tensor x = Qwen2Embed(config, base, adapter, tokens, options);
  x = Qwen2Layers(config, base, adapter, x, options);
  return Qwen2FinalNorm(config, base, adapter, x);
}

}  // namespace lorastep
