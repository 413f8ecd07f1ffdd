// Context parallelism: the tokens of one packed row of sequences split over the ranks of a
// group, with causal attention across the split (the building blocks; the layer, trainer
// and mesh use them once the cp mesh dimension exists).
//
// Layout: each sequence of n tokens is cut into 2*cp chunks of n / (2cp) tokens (the first
// n % (2cp) chunks one longer); group rank r holds chunks r and 2cp-1-r of every sequence.
// Causal attention costs more for late queries, so pairing an early chunk with its mirror
// gives every rank the same work (Megatron's load-balanced context parallelism).
//
// Collectives run synchronously on the calling thread; a failure throws StatusError (GuardTorch
// turns it back into the status). Every rank of the group calls these in the same order.
#ifndef LORASTEP_LIB_PARALLEL_CONTEXT_PARALLEL_H_
#define LORASTEP_LIB_PARALLEL_CONTEXT_PARALLEL_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "lib/parallel/process_groups.h"

namespace lorastep {

// The positions in the packed row (sequences back to back, `lengths` long) of the tokens
// context rank `rank` of `cp` holds, ascending: its two chunks of each sequence.
std::vector<int64_t> ContextShardTokens(const std::vector<int64_t>& lengths, int cp, int rank);

// One rank's share of a packed row, with what attention and the reassembly of per-token
// results need.
struct ContextShare {
  std::vector<int64_t> tokens;        // ContextShardTokens: packed positions held here, ascending
  std::vector<int64_t> sequence_ids;  // each held token's sequence (index into `lengths`)
  std::vector<int64_t> counts;        // every rank's token count, in group-rank order
  std::vector<int64_t> gather_order;  // every rank's packed positions, in group-rank order
};
ContextShare MakeContextShare(const std::vector<int64_t>& lengths, int cp, int rank);

// The whole row [total, ...] of a per-token result from every rank's share of it (x: this
// rank's rows, in `share.tokens` order). Not differentiable; every rank gets the row.
at::Tensor GatherContextShares(const at::Tensor& x, CommGroup* group, const ContextShare& share);

// Rows of x from every rank of the group, in group-rank order: [sum of counts, ...], where
// counts[j] is rank j's row count (every rank passes the same counts; x has counts[rank]
// rows). Backward sums the gradient over the group and returns this rank's rows. Identity on
// a null or single-rank group.
at::Tensor GatherContextRows(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& counts);

// Causal attention of this rank's queries over every rank's keys and values: q [t, heads, d],
// k and v [t, kv_heads, d] (t: this rank's tokens; kv_heads divides heads), seq and pos [t]
// int64: each token's sequence and its position in that sequence. Query i attends to key j
// (of any rank) iff they share the sequence and pos_j <= pos_i. Returns [t, heads, d].
// Differentiable in q, k and v; the keys' and values' gradients go back to the ranks that hold
// them (GatherContextRows). The scores are materialized ([heads, t, total], fp32) on every
// device. `window` > 0: a sliding layer's, where query i also needs pos_i - pos_j < window;
// `sinks` [heads] (defined: gpt-oss): a sink logit per head joins each softmax's denominator.
at::Tensor ContextParallelAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& seq, const at::Tensor& pos, CommGroup* group,
                                    const std::vector<int64_t>& counts, int64_t window = 0,
                                    const at::Tensor& sinks = at::Tensor());

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARALLEL_CONTEXT_PARALLEL_H_
