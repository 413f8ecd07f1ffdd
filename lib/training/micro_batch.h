// One micro-batch's inputs, built on the host and moved to the device before any compute:
// the token grid (padded rows, or sequences packed back to back), the positions whose
// log-probs are read, targets, and the loss's per-position inputs; with context parallelism
// only this rank's share of every sequence.
#ifndef LORASTEP_LIB_TRAINING_MICRO_BATCH_H_
#define LORASTEP_LIB_TRAINING_MICRO_BATCH_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "lib/model/adapter.h"
#include "lib/model/model_config.h"
#include "lib/model/qwen2.h"
#include "lib/parallel/context_parallel.h"
#include "lib/training/batch.h"
#include "lib/training/losses.h"

namespace lorastep {

struct MicroBatch {
  const std::vector<size_t>* datums = nullptr;  // indices into the call's datums
  int64_t b = 0, longest = 0;                   // rows and their length (packed: 1 x tokens)
  at::Tensor tokens, positions, targets;        // on the device
  bool is_packed = false;  // tokens [1, total] with `packed`, else [b, longest]
  PackedSequences packed;
  // The loss's per-position inputs, on the device before any compute: a host-to-device copy
  // of pageable memory waits for the stream, so none may run between micro-batches.
  LossInputs loss_in;
  bool filler = false;   // expert parallelism: keeps the group's micro-batch counts equal
  ContextShare context;  // context parallelism: this rank's share of the packed row
};

// Token and FLOP counts of the micro-batches built so far (this rank's share with cp).
struct MicroBatchCounts {
  double physical = 0;     // token slots computed (padding included)
  double real_tokens = 0;  // datum tokens
  double flops = 0;        // model FLOPs (DatumFlops)
};

struct MicroBatchOptions {
  bool pack_sequences = true;  // pack unless every datum has the same length
  bool backward = false;       // build the loss inputs
  CommGroup* context_group = nullptr;  // context parallelism: always packed, this rank's share
  bool always_pack = false;  // one packed row even when every datum has the same length (co-scheduling)
  // The flash varlen kernel serves this model's attention on its device and dtype
  // (compat::HasVarlenAttention): datums of equal length are then packed where a layer has a
  // sliding window or sinks, which padded rows would take through an explicit mask.
  bool varlen_attention = false;
  // The head scores only the loss-bearing positions (LossMask != 0): for a training call that
  // returns no log-probs, the others add nothing to its loss, gradients or metrics, and the
  // LM head over them (prompt tokens in RL) is pure cost. `positions`, `targets` and the
  // per-position loss inputs then hold those positions only.
  bool loss_positions_only = false;
  double matmul_passes = 1;  // for DatumFlops
  double lora_params = 0;
};

// Model FLOPs of a datum of n tokens: matmul FLOPs per token times n, plus causal attention
// (QK^T and AV, 2*2*d per query-key pair, n(n+1)/2 pairs per layer). `matmul_passes`: 1
// forward, 2 forward + dgrad (LoRA: frozen weights have no wgrad), 3 forward + dgrad + wgrad.
double DatumFlops(const ModelConfig& c, int64_t n, double matmul_passes, double lora_params);

// MicroBatchOptions::lora_params of a run: its LoRA factors' elements (0 for full fine-tuning,
// whose trainable weights the matmul passes count already).
double LoraParameterCount(const Adapter& adapter);

// Micro-batch `indices` of `datums`, its tensors on `device`; adds its counts to `counts`.
MicroBatch BuildMicroBatch(const std::vector<Datum>& datums, const std::vector<size_t>& indices,
                           const ModelConfig& config, const MicroBatchOptions& options, const c10::Device& device,
                           MicroBatchCounts* counts);

// A call's loss denominators over all its datums (so micro-batch losses sum to the batch
// loss), per-sample counts on `device`; `totals` (a mesh's whole batch) replaces the
// batch-wide counts where given.
LossDenominators CallDenominators(const std::vector<Datum>& datums, const BatchTotals* totals,
                                  const c10::Device& device);

// A filler for expert parallelism: one padding token, no datums, no loss.
MicroBatch FillerMicroBatch(const c10::Device& device);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_MICRO_BATCH_H_
