#include "server/batch_split.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/training/metrics.h"
#include "rpc/proto_convert.h"

namespace lorastep {

absl::Status BatchSplit::CheckShardable(int num_datums) const {
  const int dp = layout_.sizes().dp;
  if (on_mesh() && num_datums < dp) {
    return absl::InvalidArgumentError(
        absl::StrCat("datums: ", num_datums, " datums cannot be split over dp = ", dp, " replicas"));
  }
  return absl::OkStatus();
}

std::vector<std::vector<int>> BatchSplit::ShardsByTokens(const std::vector<Datum>& datums) const {
  const int dp = on_mesh() ? layout_.sizes().dp : 1;
  std::vector<std::vector<int>> shards(dp);
  // Longest first onto the lightest replica (LPT); each shard then back in request order.
  std::vector<int> order(datums.size());
  for (size_t i = 0; i < datums.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return datums[a].tokens.size() > datums[b].tokens.size(); });
  std::vector<int64_t> load(dp, 0);
  for (int i : order) {
    const int lightest = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    shards[lightest].push_back(i);
    load[lightest] += static_cast<int64_t>(datums[i].tokens.size());
  }
  for (auto& shard : shards) std::sort(shard.begin(), shard.end());
  return shards;
}

const std::vector<int>& BatchSplit::ShardOfRank(const std::vector<std::vector<int>>& shards, int rank) const {
  return shards[ShardIndexOfRank(rank)];
}

bool BatchSplit::Reports(int rank) const {
  const RankCoords c = layout_.Coords(rank);
  return c.tp == 0 && c.pp == layout_.sizes().pp - 1;
}

std::pair<int, int> BatchSplit::PromptShareOfRank(int num_prompts, int rank) const {
  const int replicas = on_mesh() ? layout_.sizes().dp : 1;
  const int per_replica = (num_prompts + replicas - 1) / replicas;
  const int replica = static_cast<int>(ShardIndexOfRank(rank));
  const int begin = std::min(num_prompts, replica * per_replica);
  return {begin, std::min(num_prompts, begin + per_replica)};
}

v1::SampleResponse BatchSplit::MergeSamples(int num_prompts, std::vector<v1::SampleResponse> per_rank) const {
  // Replicas in prompt order: their shares are contiguous and ascending.
  std::vector<std::pair<int, int>> reporters;  // (first prompt, rank)
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const int rank = static_cast<int>(r);
    const auto [begin, end] = PromptShareOfRank(num_prompts, rank);
    if (begin < end && (!on_mesh() || Reports(rank))) reporters.emplace_back(begin, rank);
  }
  std::sort(reporters.begin(), reporters.end());
  v1::SampleResponse merged;
  for (const auto& [begin, rank] : reporters) {
    v1::SampleResponse& part = per_rank[rank];
    if (merged.prompts_size() == 0) merged.set_learner_version(part.learner_version());
    for (v1::PromptSamples& p : *part.mutable_prompts()) *merged.add_prompts() = std::move(p);
    for (const auto& [name, value] : part.metrics()) (*merged.mutable_metrics())[name] += value;
  }
  return merged;
}

v1::ForwardBackwardResponse BatchSplit::MergeForward(const std::vector<std::vector<int>>& shards, int num_datums,
                                                     const std::vector<v1::WorkerForwardBackwardResponse>& per_rank) const {
  if (!on_mesh()) return per_rank[0].result();
  v1::ForwardBackwardResponse out;
  std::vector<Metrics> metrics;
  std::vector<bool> reporting;
  for (int i = 0; i < num_datums; ++i) out.add_logprobs();
  for (size_t r = 0; r < per_rank.size(); ++r) {
    metrics.push_back(MetricsFromPartials(per_rank[r].partials()));
    const bool reports = Reports(static_cast<int>(r));
    reporting.push_back(reports);
    if (!reports) continue;
    const std::vector<int>& shard = ShardOfRank(shards, static_cast<int>(r));
    for (size_t j = 0; j < shard.size(); ++j) {
      *out.mutable_logprobs(shard[j]) = per_rank[r].result().logprobs(static_cast<int>(j));
    }
  }
  MetricsToProto(MergeRankMetrics(metrics, reporting), out.mutable_metrics());
  return out;
}

v1::StepResponse BatchSplit::MergeSteps(std::vector<v1::WorkerStepResponse> per_rank, std::string* diverged) const {
  diverged->clear();
  if (!on_mesh()) {
    v1::StepResponse resp = std::move(*per_rank[0].mutable_result());
    resp.set_replicas_equal(true);  // one copy: nothing to compare
    return resp;
  }
  v1::StepResponse resp = per_rank[0].result();
  std::vector<Metrics> metrics;
  std::vector<bool> reporting;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    metrics.push_back(MetricsFromPartials(per_rank[r].partials()));
    reporting.push_back(Reports(static_cast<int>(r)));
  }
  resp.clear_metrics();
  MetricsToProto(MergeRankMetrics(metrics, reporting), resp.mutable_metrics());
  CompareReplicas(per_rank, &resp, diverged);
  return resp;
}

void BatchSplit::CompareReplicas(const std::vector<v1::WorkerStepResponse>& per_rank, v1::StepResponse* resp,
                                 std::string* diverged) const {
  // (stage, tensor rank or -1, ep rank or -1, family) -> ranks that hold a copy
  std::map<std::tuple<int, int, int, std::string>, std::vector<int>> families;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const RankCoords c = layout_.Coords(static_cast<int>(r));
    for (const auto& [family, sha] : per_rank[r].replica_digests()) {
      const ReplicaScope scope = ReplicaFamilyScope(family);
      families[{c.pp, scope.per_tensor_rank ? c.tp : -1, scope.per_expert_rank ? c.ep : -1, family}].push_back(
          static_cast<int>(r));
    }
  }
  bool all_equal = true;
  for (const auto& [key, ranks] : families) {
    const auto& [stage, tensor_rank, expert_rank, family] = key;
    v1::ReplicaHash* h = resp->add_replica_hashes();
    h->set_stage(stage);
    h->set_tensor_rank(tensor_rank);
    h->set_expert_rank(expert_rank);
    h->set_family(family);
    const std::string& first = per_rank[ranks[0]].replica_digests().at(family);
    h->set_sha256(first);
    std::vector<int> differing;
    for (int r : ranks) {
      h->add_ranks(r);
      if (per_rank[r].replica_digests().at(family) != first) differing.push_back(r);
    }
    h->set_equal(differing.empty());
    if (differing.empty()) continue;
    for (int r : ranks) h->add_sha256_by_rank(per_rank[r].replica_digests().at(family));
    all_equal = false;
    absl::StrAppend(diverged, diverged->empty() ? "" : "; ", "stage ", stage, " ", family,
                    tensor_rank >= 0 ? absl::StrCat(" (tensor rank ", tensor_rank, ")") : "",
                    expert_rank >= 0 ? absl::StrCat(" (ep rank ", expert_rank, ")") : "", ": ranks ",
                    absl::StrJoin(differing, ","), " differ from rank ", ranks[0]);
  }
  resp->set_replicas_equal(all_equal);
}

absl::StatusOr<CallBatch> CallBatch::Read(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                          const v1::PackedDatums& packed, const PackedDatumsWire* packed_wire,
                                          bool as_sent) {
  CallBatch batch;
  if (packed_wire != nullptr && as_sent && datums.empty() && packed_wire->num_datums() > 0) {
    batch.as_sent_ = packed_wire;
    return batch;
  }
  auto parsed = packed_wire != nullptr ? packed_wire->Datums(datums) : RequestDatums(datums, packed);
  if (!parsed.ok()) return parsed.status();
  batch.datums_ = *std::move(parsed);
  return batch;
}

int CallBatch::num_datums() const {
  return parsed() ? static_cast<int>(datums_.size()) : as_sent_->num_datums();
}

int64_t CallBatch::num_targets() const {
  if (!parsed()) return as_sent_->num_positions();
  int64_t targets = 0;
  for (const Datum& d : datums_) targets += static_cast<int64_t>(d.target_tokens.size());
  return targets;
}

absl::Status CallBatch::Split(const BatchSplit& split) {
  if (absl::Status s = split.CheckShardable(num_datums()); !s.ok()) return s;
  if (!parsed()) return absl::OkStatus();  // one worker takes all of it
  shards_ = split.ShardsByTokens(datums_);
  wire_.emplace(shards_.size());
  return absl::OkStatus();
}

BatchShard CallBatch::ShardOfRank(const BatchSplit& split, int rank, std::chrono::system_clock::time_point deadline) {
  BatchShard shard;
  shard.deadline = deadline;
  if (!parsed()) {
    shard.as_sent = as_sent_;
    return shard;
  }
  shard.datums = &datums_;
  shard.indices = &split.ShardOfRank(shards_, rank);
  shard.wire = &*wire_;
  shard.shard = split.ShardIndexOfRank(rank);
  return shard;
}

}  // namespace lorastep
