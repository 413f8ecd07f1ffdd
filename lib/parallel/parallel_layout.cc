#include "lib/parallel/parallel_layout.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lorastep {

const char* GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTensor: return "tensor";
    case GroupKind::kData: return "data";
    case GroupKind::kPipeline: return "pipeline";
    case GroupKind::kStage: return "stage";
    case GroupKind::kModelParallel: return "model_parallel";
    case GroupKind::kWorld: return "world";
    case GroupKind::kEmbedding: return "embedding";
    case GroupKind::kExpert: return "expert";
    case GroupKind::kExpertData: return "expert_data";
    case GroupKind::kExpertStage: return "expert_stage";
    case GroupKind::kContext: return "context";
  }
  return "unknown";
}

absl::StatusOr<ParallelLayout> ParallelLayout::Create(const ParallelSizes& sizes, int world_size) {
  if (sizes.tp < 1) return absl::InvalidArgumentError(absl::StrCat("tp: must be >= 1, got ", sizes.tp));
  if (sizes.pp < 1) return absl::InvalidArgumentError(absl::StrCat("pp: must be >= 1, got ", sizes.pp));
  if (sizes.dp < 1) return absl::InvalidArgumentError(absl::StrCat("dp: must be >= 1, got ", sizes.dp));
  if (sizes.ep < 1 || sizes.dp % sizes.ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep: must be >= 1 and divide dp ", sizes.dp, ", got ", sizes.ep));
  }
  if (sizes.cp < 1) return absl::InvalidArgumentError(absl::StrCat("cp: must be >= 1, got ", sizes.cp));
  if (sizes.cp > 1 && sizes.ep > 1) {
    return absl::InvalidArgumentError(absl::StrCat("cp: context parallelism (cp ", sizes.cp,
                                                   ") with expert parallelism (ep ", sizes.ep, ") is not built"));
  }
  if (static_cast<int64_t>(sizes.tp) * sizes.pp * sizes.dp * sizes.cp != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: ", world_size, " != tp * pp * dp * cp = ", sizes.tp,
                                                   " * ", sizes.pp, " * ", sizes.dp, " * ", sizes.cp));
  }
  return ParallelLayout(sizes);
}

RankCoords ParallelLayout::Coords(int rank) const {
  RankCoords c;
  c.tp = rank % sizes_.tp;
  c.cp = (rank / sizes_.tp) % sizes_.cp;
  c.dp = (rank / (sizes_.tp * sizes_.cp)) % sizes_.dp;
  c.pp = rank / (sizes_.tp * sizes_.cp * sizes_.dp);
  c.ep = c.dp % sizes_.ep;
  return c;
}

int ParallelLayout::Rank(const RankCoords& c) const {
  return c.tp + sizes_.tp * (c.cp + sizes_.cp * (c.dp + sizes_.dp * c.pp));
}

namespace {

// Whether ranks with coordinates a and b fall into the same group of `kind`.
bool SameGroup(GroupKind kind, const RankCoords& a, const RankCoords& b, int ep) {
  switch (kind) {
    // (cp > 1 only with ep = 1: an expert group is then one rank, expert-data the data group.)
    case GroupKind::kExpert: return a.pp == b.pp && a.tp == b.tp && a.cp == b.cp && a.dp / ep == b.dp / ep;
    case GroupKind::kExpertData: return a.pp == b.pp && a.tp == b.tp && a.ep == b.ep;
    case GroupKind::kExpertStage: return a.pp == b.pp && a.ep == b.ep;
    case GroupKind::kTensor: return a.pp == b.pp && a.dp == b.dp && a.cp == b.cp;
    case GroupKind::kData: return a.pp == b.pp && a.tp == b.tp;
    case GroupKind::kPipeline: return a.tp == b.tp && a.dp == b.dp && a.cp == b.cp;
    case GroupKind::kStage: return a.pp == b.pp;
    case GroupKind::kModelParallel: return a.dp == b.dp && a.cp == b.cp;
    case GroupKind::kContext: return a.pp == b.pp && a.tp == b.tp && a.dp == b.dp;
    case GroupKind::kWorld: return true;
    case GroupKind::kEmbedding: break;
  }
  return false;
}

}  // namespace

std::vector<int> ParallelLayout::Group(GroupKind kind, int rank) const {
  const RankCoords me = Coords(rank);
  if (kind == GroupKind::kEmbedding) {
    const int last = sizes_.pp - 1;
    if (sizes_.pp == 1 || (me.pp != 0 && me.pp != last)) return {rank};
    RankCoords first = me, final_stage = me;
    first.pp = 0, final_stage.pp = last;
    return {Rank(first), Rank(final_stage)};
  }
  std::vector<int> ranks;
  for (int r = 0; r < world_size(); ++r) {
    if (SameGroup(kind, me, Coords(r), sizes_.ep)) ranks.push_back(r);
  }
  return ranks;
}

std::vector<std::vector<int>> ParallelLayout::Groups(GroupKind kind) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> seen(world_size(), false);
  for (int r = 0; r < world_size(); ++r) {
    if (seen[r]) continue;
    groups.push_back(Group(kind, r));
    for (int m : groups.back()) seen[m] = true;
  }
  return groups;
}

int ParallelLayout::GroupIndex(GroupKind kind, int rank) const {
  const auto groups = Groups(kind);
  for (size_t i = 0; i < groups.size(); ++i) {
    for (int m : groups[i]) {
      if (m == rank) return static_cast<int>(i);
    }
  }
  return -1;
}

std::string ParallelLayout::ToString() const {
  return absl::StrCat("tp", sizes_.tp, " x pp", sizes_.pp, " x dp", sizes_.dp,
                      sizes_.cp > 1 ? absl::StrCat(" x cp", sizes_.cp) : "",
                      sizes_.ep > 1 ? absl::StrCat(", ep", sizes_.ep) : "");
}

std::vector<int> SharedFactorGroup(const ParallelLayout& layout, int rank) {
  return layout.Group(GroupKind::kStage, rank);
}

absl::Status SharedFactorGroupCheck(const ParallelLayout& layout, const std::vector<int>& ranks) {
  if (ranks.empty()) return absl::FailedPreconditionError("shared-factor group: no ranks");
  const int stage = layout.Coords(ranks[0]).pp;
  for (int r : ranks) {
    if (r < 0 || r >= layout.world_size()) {
      return absl::FailedPreconditionError(absl::StrCat("shared-factor group: rank ", r, " outside the mesh"));
    }
    if (layout.Coords(r).pp != stage) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-factor group {", absl::StrJoin(ranks, ","), "} crosses the pipeline axis (rank ",
          ranks[0], " is on stage ", stage, ", rank ", r, " on stage ", layout.Coords(r).pp,
          "); shared expert factors reduce within one stage"));
    }
  }
  return absl::OkStatus();
}

ReplicaScope ReplicaFamilyScope(const std::string& family) {
  ReplicaScope scope;
  const bool expert = family.rfind("experts", 0) == 0 || family.rfind("grad_experts", 0) == 0;
  scope.per_expert_rank = expert;
  scope.per_tensor_rank = family == "trainable" || family == "experts";
  return scope;
}

std::pair<int64_t, int64_t> EvenRange(int64_t total, int parts, int index) {
  const int64_t base = total / parts, extra = total % parts;
  const int64_t begin = index * base + std::min<int64_t>(index, extra);
  return {begin, begin + base + (index < extra ? 1 : 0)};
}

absl::Status ValidateLayoutForModel(const ParallelSizes& sizes, const ModelConfig& c) {
  if (c.num_attention_heads % sizes.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp: ", sizes.tp, " does not divide num_attention_heads ",
                                                   c.num_attention_heads));
  }
  if (c.num_key_value_heads % sizes.tp != 0 && sizes.tp % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tp: ", sizes.tp, " neither divides nor is a multiple of num_key_value_heads ",
        c.num_key_value_heads));
  }
  if (c.intermediate_size % sizes.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp: ", sizes.tp, " does not divide intermediate_size ",
                                                   c.intermediate_size));
  }
  if (c.is_moe()) {
    if (c.moe.moe_intermediate_size % sizes.tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tp: ", sizes.tp, " does not divide moe_intermediate_size ", c.moe.moe_intermediate_size));
    }
    if (c.moe.shared_expert_intermediate_size % sizes.tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tp: ", sizes.tp, " does not divide shared_expert_intermediate_size ",
                       c.moe.shared_expert_intermediate_size));
    }
    if (c.moe.num_experts % sizes.ep != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ep: ", sizes.ep, " does not divide num_experts ", c.moe.num_experts));
    }
  } else if (sizes.ep > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep: ", sizes.ep, " needs a MoE model (this one has no routed experts)"));
  }
  if (c.HasLinearAttention() && c.linear_attention.num_key_heads % sizes.tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tp: ", sizes.tp, " does not divide linear_num_key_heads ",
                                                   c.linear_attention.num_key_heads));
  }
  if (sizes.tp > c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("tp: ", sizes.tp, " exceeds vocab_size ", c.vocab_size));
  }
  if (sizes.pp > c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("pp: ", sizes.pp, " exceeds num_hidden_layers ",
                                                   c.num_hidden_layers));
  }
  return absl::OkStatus();
}

ModelShard MakeModelShard(const ParallelSizes& sizes, const RankCoords& coords,
                          const ModelConfig& c) {
  ModelShard s;
  s.tp = sizes.tp;
  s.tp_rank = coords.tp;
  s.pp = sizes.pp;
  s.pp_rank = coords.pp;
  s.cp = sizes.cp;
  std::tie(s.layer_begin, s.layer_end) = EvenRange(c.num_hidden_layers, sizes.pp, coords.pp);
  s.heads = c.num_attention_heads / sizes.tp;
  s.head_begin = s.heads * coords.tp;
  if (c.num_key_value_heads >= sizes.tp) {
    s.kv_heads = c.num_key_value_heads / sizes.tp;
    s.kv_head_begin = s.kv_heads * coords.tp;
  } else {  // fewer KV heads than ranks: all of them, replicated; use the one our queries read
    s.kv_heads = c.num_key_value_heads;
    s.kv_head_begin = 0;
    s.kv_replicated = sizes.tp > 1;
    s.kv_select = s.kv_replicated ? s.head_begin / (c.num_attention_heads / c.num_key_value_heads) : -1;
  }
  const int64_t ffn = c.intermediate_size / sizes.tp;
  s.ffn_begin = ffn * coords.tp;
  s.ffn_end = s.ffn_begin + ffn;
  std::tie(s.vocab_begin, s.vocab_end) = EvenRange(c.vocab_size, sizes.tp, coords.tp);
  s.ep = sizes.ep;
  s.ep_rank = coords.dp % sizes.ep;
  std::tie(s.expert_begin, s.expert_end) = EvenRange(c.moe.num_experts, sizes.ep, s.ep_rank);
  std::tie(s.moe_ffn_begin, s.moe_ffn_end) = EvenRange(c.moe.moe_intermediate_size, sizes.tp, coords.tp);
  std::tie(s.shared_ffn_begin, s.shared_ffn_end) =
      EvenRange(c.moe.shared_expert_intermediate_size, sizes.tp, coords.tp);
  s.linear_key_heads = c.linear_attention.num_key_heads / sizes.tp;
  s.linear_key_head_begin = s.linear_key_heads * coords.tp;
  s.linear_value_heads = c.linear_attention.num_value_heads / sizes.tp;
  s.linear_value_head_begin = s.linear_value_heads * coords.tp;
  return s;
}

bool IsColumnParallel(int slot) { return slot != 3 && slot != 6 && slot != 11; }  // o, down, out_proj

LinearSplit LinearSplitOf(const ModelShard& s, int slot, const ModelConfig& c, bool moe_layer) {
  const int64_t d = c.head_dim();
  LinearSplit split;
  split.dim = IsColumnParallel(slot) ? 0 : 1;
  switch (slot) {
    case 0: {  // q rows: this rank's query heads (with their output gates: Qwen3.5)
      const int64_t width = c.gated_attention() ? 2 * d : d;
      split.begin = s.head_begin * width;
      split.end = (s.head_begin + s.heads) * width;
      break;
    }
    case 3:  // o columns: this rank's query heads
      split.begin = s.head_begin * d;
      split.end = (s.head_begin + s.heads) * d;
      break;
    case 1: case 2:  // k, v: this rank's key/value heads
      split.begin = s.kv_head_begin * d;
      split.end = (s.kv_head_begin + s.kv_heads) * d;
      split.replicated = s.kv_replicated;
      break;
    case 4: case 5: case 6:  // gate, up rows; down columns (of the shared expert on a MoE layer)
      split.begin = moe_layer ? s.shared_ffn_begin : s.ffn_begin;
      split.end = moe_layer ? s.shared_ffn_end : s.ffn_end;
      break;
    case 7: {  // in_proj_qkv rows: this rank's key heads' q and k rows, and its value heads' v rows
      const LinearAttentionConfig& la = c.linear_attention;
      split.groups = {la.key_dim(), la.key_dim(), la.value_dim()};
      break;
    }
    default: {  // in_proj_z rows, in_proj_b / in_proj_a rows, out_proj columns: this rank's value heads
      const int64_t per_head = slot == 9 || slot == 10 ? 1 : c.linear_attention.value_head_dim;
      split.begin = s.linear_value_head_begin * per_head;
      split.end = (s.linear_value_head_begin + s.linear_value_heads) * per_head;
      break;
    }
  }
  return split;
}

LinearAttentionConfig LocalLinearAttention(const ModelConfig& config, const ModelShard* shard) {
  LinearAttentionConfig local = config.linear_attention;
  if (shard != nullptr) {
    local.num_key_heads = shard->linear_key_heads;
    local.num_value_heads = shard->linear_value_heads;
  }
  return local;
}

}  // namespace lorastep
