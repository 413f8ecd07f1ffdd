// The activation planner: the bytes a call's micro-batches need at each recomputation level,
// the worker's budget, the level each micro-batch runs at (kAuto: the least that fits) and
// the refusal that says what would fit. Members of Trainer (lib/training/trainer.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lib/device_stats.h"
#include "lib/status_macros.h"
#include "lib/training/micro_batch.h"
#include "lib/training/trainer.h"

namespace lorastep {

namespace {

const char* RecomputeName(LayerRecompute level) {
  switch (level) {
    case LayerRecompute::kNone: return "none";
    case LayerRecompute::kSelective: return "selective";
    case LayerRecompute::kFull: return "full";
  }
  return "?";
}

}  // namespace

int64_t Trainer::ActivationBudgetBytes() const {
  const int64_t budget = options_.max_activation_bytes;
  if (budget != 0) return budget < 0 ? -1 : budget;
  // What the device (CUDA) or this process (CPU) can still allocate.
  const int64_t available = base_->device.is_cuda() ? CudaAvailableBytes(base_->device) : AvailableHostMemoryBytes();
  if (available < 0) return -1;
  return available / 10 * 8;  // room for the allocator and everything else
}

bool Trainer::MlpActivationKept() const {
  // LoRA on down_proj in the fused form rebuilds the SwiGLU activation in backward, and a
  // frozen down_proj keeps no input: the activation stays only for full fine-tuning and for
  // a down_proj LoRA with dropout or unfused weight gradients.
  const bool down_lora = adapter_->lora(0, kDownProj) != nullptr;
  return adapter_->full_finetune() || (down_lora && (options_.lora.dropout > 0 || !options_.grad.fused_wgrad));
}

absl::Status Trainer::CheckActivationBudget(const std::vector<Datum>& datums, const BatchOptions& batch,
                                            bool backward, std::vector<LayerRecompute>* recompute,
                                            std::vector<bool>* rule_kept_fits) const {
  const ActivationRecompute mode = !backward                     ? ActivationRecompute::kNone
                                   : batch.activation_recompute ? *batch.activation_recompute
                                                                : options_.activation_recompute;
  // The level a fixed mode asks for; kAuto picks per micro-batch below.
  const LayerRecompute fixed = mode == ActivationRecompute::kFull        ? LayerRecompute::kFull
                               : mode == ActivationRecompute::kSelective ? LayerRecompute::kSelective
                                                                         : LayerRecompute::kNone;
  const int64_t max_tokens = batch.max_tokens_per_microbatch > 0 ? batch.max_tokens_per_microbatch
                                                                 : options_.max_tokens_per_microbatch;
  const auto micro_batches = SplitMicroBatches(datums, max_tokens);
  if (recompute != nullptr) recompute->assign(micro_batches.size(), fixed);
  const int64_t budget = ActivationBudgetBytes();
  // Without a budget every linear-attention rule keeps its intermediates (no second run).
  if (rule_kept_fits != nullptr) rule_kept_fits->assign(micro_batches.size(), budget < 0);
  if (budget < 0) return absl::OkStatus();
  const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(base_->dtype));
  const bool mlp_activation_kept = MlpActivationKept();
  const double b = static_cast<double>(budget);
  // Context parallelism: each rank holds 1/cp of every sequence, always packed.
  const int64_t cp = options_.groups != nullptr ? options_.groups->layout().sizes().cp : 1;
  const bool packed = options_.pack_sequences || cp > 1;
  for (size_t m = 0; m < micro_batches.size(); ++m) {
    const auto& mb = micro_batches[m];
    int64_t longest = 0, total = 0, sent = 0;
    std::vector<int64_t> lengths;  // this rank's tokens of each sequence
    for (size_t d : mb) {
      sent += static_cast<int64_t>(datums[d].tokens.size());
      lengths.push_back((static_cast<int64_t>(datums[d].tokens.size()) + cp - 1) / cp);
      longest = std::max(longest, lengths.back());
      total += lengths.back();
    }
    const int64_t count = static_cast<int64_t>(mb.size());
    auto need = [&](LayerRecompute level, bool rule_kept = false) {
      if (!backward) level = LayerRecompute::kNone;  // a forward keeps nothing to recompute
      return packed
                 ? EstimatePackedActivationBytes(base_->config, base_->shard, lengths, backward, element_bytes,
                                                 options_.logprob_chunk_tokens, level, mlp_activation_kept, rule_kept)
                 : EstimateActivationBytes(base_->config, base_->shard, count, longest, backward, element_bytes,
                                           options_.logprob_chunk_tokens, level, mlp_activation_kept, rule_kept);
    };
    // Whether the layers' linear-attention rules may keep their intermediates at level kNone
    // (else each runs again in its backward); the other levels keep them in the replay.
    if (rule_kept_fits != nullptr && backward) {
      (*rule_kept_fits)[m] = need(LayerRecompute::kNone, /*rule_kept=*/true) <= b;
    }
    // kAuto: the least recomputation that fits. Selective never costs more time than full
    // (its replay skips attention's forward where the kernel keeps its statistics, and
    // otherwise runs attention once in backward as full does), only the kept attention.
    const double plain = need(LayerRecompute::kNone);
    LayerRecompute level = fixed;
    if (mode == ActivationRecompute::kAuto) {
      level = plain <= b                                 ? LayerRecompute::kNone
              : need(LayerRecompute::kSelective) <= b ? LayerRecompute::kSelective
                                                         : LayerRecompute::kFull;
    }
    if (recompute != nullptr) (*recompute)[m] = level;
    const double used = level == LayerRecompute::kNone ? plain : need(level);
    if (used <= b) continue;
    // Refused: say what more recomputation would need, and how long a micro-batch fits.
    std::string hint;
    if (backward && level != LayerRecompute::kFull) {
      const LayerRecompute more = level == LayerRecompute::kNone && need(LayerRecompute::kSelective) <= b
                                      ? LayerRecompute::kSelective
                                      : LayerRecompute::kFull;
      hint = need(more) <= b ? absl::StrFormat("; with %s activation recomputation it needs about %.4g MiB and fits "
                                               "(activation_recompute %s)",
                                               RecomputeName(more), need(more) / (1 << 20),
                                               more == LayerRecompute::kFull ? "\"auto\" or \"full\"" : "\"auto\" or \"selective\"")
                             : absl::StrFormat("; even with full activation recomputation it needs about %.4g MiB",
                                               need(LayerRecompute::kFull) / (1 << 20));
    } else if (backward) {
      hint = " with full activation recomputation";
    }
    // The longest single sequence that fits at this budget (the estimate grows with the
    // tokens, so a bisection finds it; cp ranks hold 1/cp of it each).
    auto longest_fitting = [&](LayerRecompute with) {
      int64_t lo = 0, hi = std::max(total, count * longest);
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        const double n = EstimatePackedActivationBytes(base_->config, base_->shard, {mid}, backward, element_bytes,
                                                       options_.logprob_chunk_tokens, with, mlp_activation_kept);
        if (n <= b) lo = mid; else hi = mid - 1;
      }
      return lo * cp;
    };
    std::string fits = absl::StrFormat("; at this budget about %d tokens fit in one micro-batch",
                                       longest_fitting(backward ? level : LayerRecompute::kNone));
    if (backward && level != LayerRecompute::kFull) {
      absl::StrAppend(&fits, absl::StrFormat(" (%d with full activation recomputation)",
                                             longest_fitting(LayerRecompute::kFull)));
    }
    return absl::ResourceExhaustedError(absl::StrFormat(
        "datums[%d]: a micro-batch of %d sequence(s), %d tokens%s, needs about %.4g MiB of "
        "activations, over this worker's budget of %.4g MiB%s%s; send shorter sequences, a smaller "
        "max_tokens_per_microbatch, use a larger cp (each context rank holds 1/cp of every sequence), or raise "
        "the worker's --max_activation_mb",
        mb.front(), count, packed ? sent : count * longest, packed ? " packed" : " padded",
        used / (1 << 20), b / (1 << 20), hint, fits));
  }
  return absl::OkStatus();
}

absl::Status Trainer::AgreeOnRecompute(std::vector<LayerRecompute>* recompute) {
  if (options_.groups == nullptr || recompute->empty()) return absl::OkStatus();
  std::vector<float> local;  // the levels in order: every rank takes the most any rank needs
  for (LayerRecompute level : *recompute) local.push_back(static_cast<float>(level));
  at::Tensor levels = at::tensor(local, at::kFloat).to(base_->device);
  LORASTEP_RETURN_IF_ERROR(options_.groups->group(GroupKind::kWorld).AllReduce(levels, ReduceKind::kMax));
  const at::Tensor host = levels.to(at::kCPU).contiguous();
  const float* most = host.data_ptr<float>();
  for (size_t i = 0; i < recompute->size(); ++i) (*recompute)[i] = static_cast<LayerRecompute>(static_cast<int>(most[i]));
  return absl::OkStatus();
}

}  // namespace lorastep
