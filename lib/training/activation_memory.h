// How much memory a micro-batch's activations need, and how much this process may still
// allocate: the estimates the Trainer checks a call against before any work.
#ifndef LORASTEP_LIB_TRAINING_ACTIVATION_MEMORY_H_
#define LORASTEP_LIB_TRAINING_ACTIVATION_MEMORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "lib/model/layer_recompute.h"
#include "lib/model/model_config.h"
#include "lib/parallel/parallel_layout.h"

namespace lorastep {

// The activation memory a micro-batch of `b` sequences padded to `s` tokens needs on this
// rank: what the layers keep for backward (forward-only: one layer's worth), ~(8H + 3I +
// 4 kv·d) model-dtype elements per token and layer (norm inputs, q/k/v before and after
// RoPE, attention output, the MLP's gate, up and product), the attention scores where the
// build has no fused attention (LibTorch < 2: b·heads·s² fp32, three copies per layer), and
// the LM head's chunk (logits, log-softmax and probabilities over the vocabulary).
// With `recompute` kFull the layers keep only their inputs (H per token and layer) and one
// layer's activations exist at a time (its replay in backward); kSelective also keeps each
// layer's attention output (heads·d) and softmax statistics (heads fp32). Gated DeltaNet
// layers keep their convolution's input and output, z, the gates, the rule's output and the
// gated norm's fp32 operands on top, and one layer's chunked-rule intermediates exist at a
// time (its backward runs the rule again), over the sequences padded to the longest; with
// `rule_kept` (kNone only: a replayed layer's rule lives as long as its replay) every such
// layer keeps what the chunked rule saves for backward instead (ForwardOptions::
// keep_linear_attention_rule). Without `mlp_activation_kept` the MLP keeps 2I, not 3I (LoRA
// runs whose down_proj rebuilds its input, or keeps none).
double EstimateActivationBytes(const ModelConfig& config, const ModelShard& shard, int64_t b, int64_t s,
                               bool backward, int64_t element_bytes, int64_t logprob_chunk_tokens,
                               LayerRecompute recompute = LayerRecompute::kNone, bool mlp_activation_kept = true,
                               bool rule_kept = false);
// The same for sequences of these lengths packed back to back (no padding).
double EstimatePackedActivationBytes(const ModelConfig& config, const ModelShard& shard,
                                     const std::vector<int64_t>& lengths, bool backward, int64_t element_bytes,
                                     int64_t logprob_chunk_tokens,
                                     LayerRecompute recompute = LayerRecompute::kNone,
                                     bool mlp_activation_kept = true, bool rule_kept = false);
// Host memory this process may still allocate: MemAvailable, capped by the room its cgroup
// limits leave (CgroupMemoryRoom).
int64_t AvailableHostMemoryBytes();
// The room this process's memory cgroups leave: the least of limit - usage over its cgroup
// and every ancestor (v2: memory.max and memory.current under `cgroup_root`; v1: the memory
// controller's memory.limit_in_bytes and memory.usage_in_bytes), from the text of
// /proc/self/cgroup. -1 when no limit applies.
int64_t CgroupMemoryRoom(const std::string& proc_self_cgroup, const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_ACTIVATION_MEMORY_H_
