// Where every rank of a tensor x context x data x pipeline parallel mesh sits, and which
// ranks form each communication group. No torch: the coordinator and the workers share it.
//
// Rank order is Megatron-LM's, tensor fastest, then context, then data, then pipeline:
//
//   rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
//
// Context parallelism splits each sequence's tokens over the cp ranks of one replica (the
// same datums, each rank its share of every sequence's positions); their gradients add up
// like data replicas', so the data group holds dp x cp ranks (Megatron's data-with-context
// group) and the context group the cp ranks of one replica. Without cp (cp = 1):
//
// so the ranks of one tensor group are adjacent (one host's NVLink domain in practice) and a
// pipeline stage owns one contiguous block of tp * dp ranks. Example, tp=2 pp=2 dp=2:
//
//   stage 0: ranks 0..3   tensor groups {0,1} {2,3}   data groups {0,2} {1,3}
//   stage 1: ranks 4..7   tensor groups {4,5} {6,7}   data groups {4,6} {5,7}
//   pipeline groups {0,4} {1,5} {2,6} {3,7}; stage (tensor+data) groups {0..3} {4..7}
//
// Expert parallelism (MoE) is carved out of the data axis, as in Megatron-LM: the dp
// replicas of a stage form dp / ep groups of ep consecutive data ranks; each group splits
// the routed experts (ep_rank = dp_rank % ep) and exchanges tokens by all-to-all. The
// expert-data group (same ep_rank) holds the same experts; the expert-stage group (same
// stage, same ep_rank: tensor x expert-data) holds the same experts' replicated factors.
// Example, tp=2 dp=2 ep=2 (one stage): expert groups {0,2} {1,3}; expert-data groups {0}
// {1} {2} {3}; expert-stage groups {0,1} {2,3}; the stage group {0..3} is still where a
// factor shared by all of a layer's experts (shared-outer LoRA) is reduced.
//
// Example:
//   ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::Create({2, 2, 2}, 8));
//   RankCoords c = layout.Coords(5);            // tp 1, dp 0, pp 1
//   std::vector<int> g = layout.Group(GroupKind::kTensor, 5);   // {4, 5}
//
// Thread-safety: immutable after Create; safe to share.
#ifndef LORASTEP_LIB_PARALLEL_PARALLEL_LAYOUT_H_
#define LORASTEP_LIB_PARALLEL_PARALLEL_LAYOUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/model/model_config.h"

namespace lorastep {

struct ParallelSizes {
  int tp = 1;  // tensor-parallel ranks (attention heads, FFN width, vocabulary split)
  int pp = 1;  // pipeline stages (contiguous layer ranges)
  int dp = 1;  // data-parallel replicas (the batch split by tokens)
  int ep = 1;  // expert-parallel ranks, carved out of dp (dp % ep == 0): experts split
  int cp = 1;  // context-parallel ranks per replica (each sequence's tokens split)
  int world() const { return tp * pp * dp * cp; }
};

struct RankCoords {
  int tp = 0;
  int pp = 0;
  int dp = 0;
  int ep = 0;  // dp % ep: which slice of the experts this rank holds
  int cp = 0;  // which share of each sequence's tokens this rank holds
  bool operator==(const RankCoords& o) const { return tp == o.tp && pp == o.pp && dp == o.dp && cp == o.cp; }
};

enum class GroupKind {
  kTensor,         // same stage, replica and context rank: shards of one model copy's layers
  kData,           // same tensor rank and stage: copies of the same shard (data x context ranks)
  kPipeline,       // same tensor rank, replica and context rank: the stages of one model copy
  kStage,          // same stage: tensor + context + data ranks (replicated LoRA factors reduce here)
  kModelParallel,  // same replica and context rank: tensor x pipeline ranks (one whole model copy)
  kWorld,
  // The first and last stage of one tensor rank and replica, which both hold the tied
  // embedding (lookup on the first, LM head on the last); a middle stage is alone in its own.
  kEmbedding,
  kExpert,       // same stage, tensor rank and expert-data index: tokens are exchanged here
  kExpertData,   // same stage, tensor rank and ep rank: replicas of the same experts
  kExpertStage,  // same stage and ep rank: tensor x expert-data (replicated expert factors)
  kContext,      // same stage, tensor rank and replica: the ranks splitting each sequence
};
const char* GroupKindName(GroupKind kind);

class ParallelLayout {
 public:
  // world_size must equal tp * pp * dp * cp; each size >= 1; cp > 1 only with ep = 1. Errors
  // name the field.
  static absl::StatusOr<ParallelLayout> Create(const ParallelSizes& sizes, int world_size);
  ParallelLayout() = default;  // world size 1

  const ParallelSizes& sizes() const { return sizes_; }
  int world_size() const { return sizes_.world(); }
  RankCoords Coords(int rank) const;
  int Rank(const RankCoords& coords) const;

  // Ranks of `kind`'s group that contains `rank`, ascending.
  std::vector<int> Group(GroupKind kind, int rank) const;
  // Every group of `kind`, each ascending, in order of their smallest rank.
  std::vector<std::vector<int>> Groups(GroupKind kind) const;
  // Index of the group of `kind` containing `rank` among Groups(kind) (a stable name for it).
  int GroupIndex(GroupKind kind, int rank) const;

  bool IsFirstStage(int rank) const { return Coords(rank).pp == 0; }
  bool IsLastStage(int rank) const { return Coords(rank).pp == sizes_.pp - 1; }

  std::string ToString() const;  // "tp2 x pp2 x dp2" (" x cp2" when cp > 1, ", ep2" when ep > 1)

 private:
  explicit ParallelLayout(ParallelSizes sizes) : sizes_(sizes) {}
  ParallelSizes sizes_;
};

// Over which ranks copies of a replica-hash family must be equal: always within a stage;
// per tensor rank unless the family is tensor-replicated; per ep rank for routed-expert
// families. Families: "trainable" (non-expert tensors; per tensor rank), "tensor_replicated",
// "shared_fc1"/"shared_fc2" and "grad_shared_fc1"/"grad_shared_fc2" (the stage), "experts"
// (per tensor and ep rank), "experts_tensor_replicated" and "grad_experts_fc1"/"_fc2"
// (per ep rank).
struct ReplicaScope {
  bool per_tensor_rank = true;
  bool per_expert_rank = false;
};
ReplicaScope ReplicaFamilyScope(const std::string& family);

// The ranks a factor shared by all experts of a layer (shared-outer LoRA) is SUM-reduced
// over: the tensor+data group of `rank`'s pipeline stage, derived from the layout (never a
// fixed tp/dp/ep assumption). A stage holds its own layers, so the group must not cross the
// pipeline axis: SharedFactorGroupCheck refuses any rank set spanning two stages
// (FAILED_PRECONDITION naming the stages), and the finalizer checks the group it uses.
std::vector<int> SharedFactorGroup(const ParallelLayout& layout, int rank);
absl::Status SharedFactorGroupCheck(const ParallelLayout& layout, const std::vector<int>& ranks);

// Half-open range [begin, end) of `total` items that part `index` of `parts` gets: contiguous,
// sizes differing by at most one, earlier parts larger.
std::pair<int64_t, int64_t> EvenRange(int64_t total, int parts, int index);

// Checks that `config` can be cut by `sizes`: tp divides num_attention_heads and
// intermediate_size; num_key_value_heads divisible by tp, or tp divisible by it (each KV
// head then replicated on tp / num_key_value_heads ranks); tp <= vocab_size;
// pp <= num_hidden_layers; MoE: tp divides moe_intermediate_size and
// shared_expert_intermediate_size, ep divides num_experts; ep > 1 only on MoE models.
// INVALID_ARGUMENT naming the flag ("tp: ...", "pp: ...", "ep: ...").
absl::Status ValidateLayoutForModel(const ParallelSizes& sizes, const ModelConfig& config);

// How one rank's shard of the model is cut. Everything a model-parallel forward needs;
// size 1 everywhere reproduces the whole model.
struct ModelShard {
  int tp = 1, tp_rank = 0;
  int pp = 1, pp_rank = 0;
  int cp = 1;  // context ranks sharing each sequence's tokens (the weights are whole on each)
  int64_t layer_begin = 0, layer_end = 0;  // this stage's decoder layers
  int64_t heads = 0;                       // query heads on this rank
  int64_t kv_heads = 0;                    // key/value heads on this rank
  int64_t head_begin = 0;                  // first query head of this rank
  int64_t kv_head_begin = 0;               // first key/value head of this rank
  // More tensor ranks than KV heads: every rank holds all KV heads (k/v weights replicated
  // on the tensor group, each rank with a partial gradient) and uses head `kv_select`.
  bool kv_replicated = false;
  int64_t kv_select = -1;
  int64_t ffn_begin = 0, ffn_end = 0;      // intermediate (SwiGLU) columns
  int64_t vocab_begin = 0, vocab_end = 0;  // embedding / LM-head rows
  // MoE: this rank's routed experts [expert_begin, expert_end) of the layer's experts (split
  // over the expert group), and its columns of each expert's SwiGLU width and of the shared
  // expert's (split over the tensor group).
  int ep = 1, ep_rank = 0;
  int64_t expert_begin = 0, expert_end = 0;
  int64_t moe_ffn_begin = 0, moe_ffn_end = 0;
  int64_t shared_ffn_begin = 0, shared_ffn_end = 0;
  // Qwen3.5's Gated DeltaNet layers: this rank's key heads and value heads (split over the
  // tensor group, a key head with the value heads it serves).
  int64_t linear_key_head_begin = 0, linear_key_heads = 0;
  int64_t linear_value_head_begin = 0, linear_value_heads = 0;
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank == pp - 1; }
  bool whole() const { return tp == 1 && pp == 1 && ep == 1; }
};
ModelShard MakeModelShard(const ParallelSizes& sizes, const RankCoords& coords,
                          const ModelConfig& config);

// How the weight [out, in] of linear `slot` (a LinearSlot) is cut on a tensor rank:
// column-parallel q/k/v/gate/up split `out` (dim 0), row-parallel o/down split `in` (dim 1).
struct LinearSplit {
  int dim = 0;           // 0: output rows (column-parallel), 1: input columns (row-parallel)
  int64_t begin = 0, end = 0;
  bool replicated = false;  // whole on every tensor rank (k/v when tp > KV heads)
  // Rows in groups (Gated DeltaNet's in_proj_qkv: its q, k and v rows): each group is split
  // evenly over the tensor ranks and this rank holds its share of each, in group order
  // (begin/end unused). Empty: one contiguous range.
  std::vector<int64_t> groups;
};
// On a MoE layer the gate/up/down slots are the shared expert's (its own width).
LinearSplit LinearSplitOf(const ModelShard& shard, int slot, const ModelConfig& config,
                          bool moe_layer = false);
bool IsColumnParallel(int slot);  // q, k, v, gate, up

// The Gated DeltaNet widths a tensor rank computes with: its key and value heads (`shard`
// null: the whole model's).
LinearAttentionConfig LocalLinearAttention(const ModelConfig& config, const ModelShard* shard);

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARALLEL_PARALLEL_LAYOUT_H_
