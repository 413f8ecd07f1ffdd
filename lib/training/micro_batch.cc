#include "lib/training/micro_batch.h"

#include <algorithm>

namespace lorastep {

namespace {

at::Tensor FloatsOrUndefined(const std::vector<const std::vector<float>*>& parts, bool any,
                             const c10::Device& device) {
  if (!any) return at::Tensor();
  std::vector<float> flat;
  for (const auto* p : parts) flat.insert(flat.end(), p->begin(), p->end());
  return at::tensor(flat, at::kFloat).to(device);
}

}  // namespace

double DatumFlops(const ModelConfig& c, int64_t n, double matmul_passes, double lora_params) {
  const double attn_pairs = 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  const double attn_fwd = 4.0 * c.num_hidden_layers * c.hidden_size * attn_pairs;
  const double attn_passes = matmul_passes > 1 ? 3.0 : 1.0;  // backward of attention is 2x
  return 2.0 * matmul_passes * static_cast<double>(c.MatmulParameterCount()) * n +
         (matmul_passes > 1 ? 6.0 : 2.0) * lora_params * n + attn_passes * attn_fwd;
}

MicroBatch BuildMicroBatch(const std::vector<Datum>& datums, const std::vector<size_t>& mb,
                           const ModelConfig& config, const MicroBatchOptions& options, const c10::Device& device,
                           MicroBatchCounts* counts) {
  MicroBatchCounts own;  // this micro-batch's counts
  CommGroup* context_group = options.context_group;
  MicroBatch data;
  data.datums = &mb;
  for (size_t d : mb) data.longest = std::max<int64_t>(data.longest, datums[d].tokens.size());
  data.b = static_cast<int64_t>(mb.size());
  std::vector<int64_t> rope_positions;
  std::vector<int32_t> cu_seqlens{0};
  // Packed into one row unless every datum has the same length: rows of equal length pad
  // nothing, and SDPA's fused kernel beats the varlen one there (docs/PERFORMANCE.md). Sliding
  // windows and sinks have no fused kernel on padded rows (an explicit mask there), so where
  // the varlen kernel serves them, their rows are packed for it.
  bool uniform = true;
  for (size_t d : mb) uniform = uniform && datums[d].tokens.size() == datums[mb.front()].tokens.size();
  const bool masked_on_rows = options.varlen_attention && (config.attention_sinks() || config.HasSlidingLayers());
  data.is_packed = (options.pack_sequences && (!uniform || masked_on_rows)) || context_group != nullptr ||
                   options.always_pack;
  if (data.is_packed) {  // one row: the datums back to back
    data.packed.max_length = data.longest;
    data.longest = 0;
    for (size_t d : mb) {
      const int64_t n = static_cast<int64_t>(datums[d].tokens.size());
      data.packed.lengths.push_back(n);
      for (int64_t i = 0; i < n; ++i) rope_positions.push_back(i);
      data.longest += n;
      cu_seqlens.push_back(static_cast<int32_t>(data.longest));
    }
  }
  // Rows of the token grid: one per datum, or one for all when packed.
  const int64_t rows = data.is_packed ? 1 : data.b;
  int64_t column = 0;  // packed: where the current datum starts
  std::vector<int64_t> tokens(rows * data.longest, 0), positions, targets, sample_of;
  std::vector<float> mask;
  std::vector<const std::vector<float>*> adv, samp, old, ref;
  for (int64_t r = 0; r < data.b; ++r) {
    const Datum& datum = datums[mb[r]];
    const int64_t n = static_cast<int64_t>(datum.tokens.size());
    const int64_t offset = data.is_packed ? column : r * data.longest;
    column += n;
    for (int64_t i = 0; i < n; ++i) {
      tokens[offset + i] = datum.tokens[i];
      positions.push_back(offset + i);
      targets.push_back(datum.target_tokens[i]);
      sample_of.push_back(static_cast<int64_t>(mb[r]));
      mask.push_back(LossMask(datum, i));
    }
    adv.push_back(&datum.advantages);
    samp.push_back(&datum.logprobs);
    old.push_back(&datum.old_logprobs);
    ref.push_back(&datum.ref_logprobs);
    own.physical += data.is_packed ? static_cast<double>(n) : static_cast<double>(data.longest);
    own.real_tokens += static_cast<double>(n);
    own.flops += DatumFlops(config, n, options.matmul_passes, options.lora_params);
  }
  data.tokens = at::tensor(tokens, at::kLong).view({rows, data.longest}).to(device);
  if (data.is_packed) {
    data.b = 1;
    data.packed.cu_seqlens = at::tensor(cu_seqlens, at::kInt).to(device);
    data.packed.positions = at::tensor(rope_positions, at::kLong).to(device);
  }
  data.positions = at::tensor(positions, at::kLong).to(device);
  data.targets = at::tensor(targets, at::kLong).to(device);
  data.loss_in.mask = at::tensor(mask, at::kFloat).to(device);
  if (options.backward) {
    data.loss_in.sample_index = at::tensor(sample_of, at::kLong).to(device);
    auto any = [](const std::vector<const std::vector<float>*>& v) {
      for (const auto* p : v) if (!p->empty()) return true;
      return false;
    };
    data.loss_in.advantages = FloatsOrUndefined(adv, any(adv), device);
    data.loss_in.sampler_logprobs = FloatsOrUndefined(samp, any(samp), device);
    data.loss_in.old_logprobs = FloatsOrUndefined(old, any(old), device);
    data.loss_in.ref_logprobs = FloatsOrUndefined(ref, any(ref), device);
  }
  double part = 1.0;  // the share of the micro-batch's tokens this rank computes
  if (context_group != nullptr) {
    // Keep this rank's tokens only: their ids, RoPE positions, targets and loss inputs;
    // the loss keeps the whole batch's denominators, so the ranks' gradients add up.
    data.context = MakeContextShare(data.packed.lengths, context_group->size(), context_group->rank());
    const int64_t total = data.longest, held = static_cast<int64_t>(data.context.tokens.size());
    const at::Tensor mine = at::tensor(data.context.tokens, at::kLong).to(device);
    data.tokens = data.tokens.index_select(1, mine);
    for (at::Tensor* t : {&data.targets, &data.packed.positions, &data.loss_in.mask, &data.loss_in.sample_index,
                          &data.loss_in.advantages, &data.loss_in.sampler_logprobs, &data.loss_in.old_logprobs,
                          &data.loss_in.ref_logprobs}) {
      if (t->defined()) *t = t->index_select(0, mine);
    }
    data.positions = at::arange(held, at::TensorOptions().dtype(at::kLong).device(device));
    data.packed.sequence_ids = at::tensor(data.context.sequence_ids, at::kLong).to(device);
    data.packed.context_group = context_group;
    data.packed.context_counts = data.context.counts;
    data.packed.context_tokens = mine;
    std::vector<int64_t> order(data.context.gather_order.size());
    for (size_t i = 0; i < order.size(); ++i) order[data.context.gather_order[i]] = static_cast<int64_t>(i);
    data.packed.context_order = at::tensor(order, at::kLong).to(device);
    data.longest = held;
    // Token and FLOP counts: this rank's share (the mesh sums the ranks').
    part = total > 0 ? static_cast<double>(held) / static_cast<double>(total) : 0.0;
  }
  if (options.loss_positions_only && options.backward) {
    // Kept positions, in order, of this rank's share (with cp, its tokens map into the row).
    std::vector<int64_t> keep;
    const int64_t held = static_cast<int64_t>(context_group != nullptr ? data.context.tokens.size() : mask.size());
    for (int64_t j = 0; j < held; ++j) {
      const int64_t global = context_group != nullptr ? data.context.tokens[j] : j;
      if (mask[global] != 0) keep.push_back(j);
    }
    if (static_cast<int64_t>(keep.size()) < held) {
      const at::Tensor kept = at::tensor(keep, at::kLong).to(device);
      for (at::Tensor* t : {&data.positions, &data.targets, &data.loss_in.mask, &data.loss_in.sample_index,
                            &data.loss_in.advantages, &data.loss_in.sampler_logprobs, &data.loss_in.old_logprobs,
                            &data.loss_in.ref_logprobs}) {
        if (t->defined()) *t = t->index_select(0, kept);
      }
    }
  }
  counts->physical += own.physical * part;
  counts->real_tokens += own.real_tokens * part;
  counts->flops += own.flops * part;
  return data;
}

MicroBatch FillerMicroBatch(const c10::Device& device) {
  static const std::vector<size_t> kNoDatums;
  MicroBatch filler;
  filler.datums = &kNoDatums;
  filler.filler = true;
  filler.b = filler.longest = 1;
  filler.tokens = at::zeros({1, 1}, at::TensorOptions().dtype(at::kLong).device(device));
  return filler;
}

double LoraParameterCount(const Adapter& adapter) {
  if (adapter.full_finetune()) return 0.0;
  double n = 0;
  for (const auto& p : adapter.parameters()) n += static_cast<double>(p.value.numel());
  return n;
}

LossDenominators CallDenominators(const std::vector<Datum>& datums, const BatchTotals* totals,
                                  const c10::Device& device) {
  LossDenominators den;
  std::vector<float> sample_tokens(datums.size(), 0.0f);
  for (size_t d = 0; d < datums.size(); ++d) {
    for (size_t i = 0; i < datums[d].tokens.size(); ++i) {
      if (LossMask(datums[d], i) != 0) sample_tokens[d] += 1;
    }
    den.loss_tokens += sample_tokens[d];
    if (sample_tokens[d] > 0) den.samples += 1;
  }
  den.sample_tokens = at::tensor(sample_tokens, at::kFloat).to(device);
  if (totals != nullptr) {
    den.loss_tokens = totals->loss_tokens;
    den.samples = totals->samples;
  }
  return den;
}

}  // namespace lorastep
