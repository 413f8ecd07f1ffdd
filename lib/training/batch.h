// Training data in Tinker's datum contract (what tinker-cookbook, SkyRL and others send):
// pre-shifted per-position inputs and targets, plus supervised weights or RL fields.
#ifndef LORASTEP_LIB_TRAINING_BATCH_H_
#define LORASTEP_LIB_TRAINING_BATCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/training/loss_config.h"

namespace lorastep {

struct Datum {
  std::vector<int64_t> tokens;         // model input, length n
  std::vector<int64_t> target_tokens;  // token predicted at each position, length n
  // Optional, length n each. weights: supervised weights / loss mask (0 = not loss-bearing).
  std::vector<float> weights;
  std::vector<float> logprobs;      // the sampler's (rollout) log-probs of target_tokens
  std::vector<float> advantages;    // RL advantages
  std::vector<float> ref_logprobs;  // reference-policy log-probs (KL penalty)
  std::vector<float> old_logprobs;  // the trainer's own old log-probs (re-scored by Forward)
};

// Loss-bearing mask of position i: weights[i] when weights are given, else (for RL losses)
// advantages[i] != 0, else 1.
float LossMask(const Datum& datum, size_t i);

// Batch-wide loss denominators. When a batch is split across calls or ranks, every part is
// normalized with the totals of the whole batch so the parts' gradients sum to the batch's.
struct BatchTotals {
  double loss_tokens = 0;  // loss-bearing positions
  double samples = 0;      // samples with at least one loss-bearing position
};
BatchTotals ComputeBatchTotals(const std::vector<Datum>& datums);

struct BatchLimits {
  int64_t max_datums = 1 << 16;
  int64_t max_tokens_per_datum = 1 << 17;
  int64_t max_total_tokens = 1 << 24;
  int64_t max_positions = 0;  // the model's max_position_embeddings (0: no such limit)
};

// Checks everything before any work: non-empty batch, consistent lengths, token ids in
// [0, vocab_size), lengths within max_positions, finite values, log-probabilities <= 0, the
// fields the loss needs. INVALID_ARGUMENT naming the field, e.g.
// "datums[3].advantages[17]: not finite".
absl::Status ValidateBatch(const std::vector<Datum>& datums, const LossConfig& loss,
                           int64_t vocab_size, const BatchLimits& limits = {});
// The subset of checks a forward-only call needs (no loss fields).
absl::Status ValidateForwardBatch(const std::vector<Datum>& datums, int64_t vocab_size,
                                  const BatchLimits& limits = {});

// Splits datums into micro-batches whose padded size (count x longest length) stays within
// max_tokens, longest datums first (ties in arrival order) so that lengths within a
// micro-batch are close; a datum longer than the budget goes alone.
std::vector<std::vector<size_t>> SplitIntoMicroBatches(const std::vector<Datum>& datums,
                                                       int64_t max_tokens);

// Packs datums back to back (no padding) into micro-batches of at most max_tokens real
// tokens: longest first (ties in arrival order), each into the first micro-batch with room
// (first-fit decreasing); a datum longer than the budget goes alone. Within a micro-batch,
// datums keep the order they were placed in.
std::vector<std::vector<size_t>> PackIntoMicroBatches(const std::vector<Datum>& datums,
                                                      int64_t max_tokens);

// Activation recomputation of a training micro-batch's layers (LayerRecompute): kAuto
// recomputes a micro-batch only where its activations would not fit the worker's budget
// otherwise, selectively where that fits, else fully; kNone, kSelective and kFull always
// use that level.
enum class ActivationRecompute { kAuto, kNone, kSelective, kFull };
// "auto", "none", "selective", "full"; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<ActivationRecompute> ParseActivationRecompute(const std::string& value, const std::string& field);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_BATCH_H_
