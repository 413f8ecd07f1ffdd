#include "lib/training/grad_finalizer.h"
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/io/digest.h"
#include "lib/status_macros.h"
#include "lib/torch_status.h"

namespace lorastep {

absl::Status FoldLocalGradients(Adapter* adapter) {
  return GuardTorch([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    auto& params = adapter->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].value.mutable_grad();
      if (!grad.defined()) continue;
      if (adapter->reductions(static_cast<int>(i)) > 0) {  // a late local gradient after the sum
        return absl::FailedPreconditionError(absl::StrCat(
            "gradient of ", params[i].name, " arrived after its cross-rank reduction this step"));
      }
      params[i].main_grad.add_(grad.to(at::kFloat));
      grad = at::Tensor();  // moved into main_grad: never added twice
    }
    return absl::OkStatus();
  });
}

namespace {

constexpr int kDigestWords = 32;  // one SHA-256, a byte per element

// A hex SHA-256 as 32 doubles (every backend gathers doubles); absent: -1s.
at::Tensor DigestWords(const std::string& hex, const at::Device& device) {
  at::Tensor t = at::full({kDigestWords}, -1.0, at::kDouble);
  for (int i = 0; i < kDigestWords && 2 * i + 1 < static_cast<int>(hex.size()); ++i) {
    t[i] = static_cast<double>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  return t.to(device);
}

std::string StringSha256(const std::string& text) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return TensorsSha256({bytes});
}

// The ranks of `kind`'s groups whose gathered digests (rows of `words`, by global rank)
// disagree, as "stage S: ranks a,b differ from rank c" clauses; empty when all agree.
// Rows of -1 (nothing to compare on that rank) are skipped.
std::vector<std::string> Disagreements(const ParallelLayout& layout, GroupKind kind,
                                       const std::vector<at::Tensor>& words) {
  std::vector<std::string> out;
  for (const std::vector<int>& group : layout.Groups(kind)) {
    int first = -1;
    std::vector<int> differing;
    for (int r : group) {
      if (words[r][0].item<double>() < 0) continue;
      if (first < 0) {
        first = r;
      } else if (!at::equal(words[r], words[first])) {
        differing.push_back(r);
      }
    }
    if (!differing.empty()) {
      out.push_back(absl::StrCat("stage ", layout.Coords(first).pp, ": ranks ",
                                 absl::StrJoin(differing, ","), " differ from rank ", first));
    }
  }
  return out;
}

}  // namespace

std::vector<SquareTerm> SquaredGradNormTerms(const Adapter& adapter, ProcessGroups* groups) {
  const RankCoords c = groups != nullptr ? groups->coords() : RankCoords{};
  const int ep = groups != nullptr ? groups->layout().sizes().ep : 1;
  // One copy of each reduced gradient counts: data replica 0's, its context rank 0's.
  const bool first_replica = c.dp == 0 && c.cp == 0, first_expert_replica = c.dp / ep == 0 && c.cp == 0;
  std::vector<SquareTerm> terms;
  auto add = [&](GradBucket b, bool counted) {
    if (counted) terms.push_back({adapter.grad_bucket(b)});
  };
  add(GradBucket::kSplit, first_replica);
  if (first_replica) {
    for (const Parameter& p : adapter.parameters()) {  // another stage counts its copy
      if (p.stage_copy) terms.push_back({p.main_grad, /*negative=*/true});
    }
  }
  add(GradBucket::kReplicatedPartial, c.tp == 0 && first_replica);
  add(GradBucket::kReplicatedFull, c.tp == 0 && first_replica);
  add(GradBucket::kSharedExpert, c.tp == 0 && first_replica);
  add(GradBucket::kExpertSplit, first_expert_replica);
  add(GradBucket::kExpertReplicatedPartial, c.tp == 0 && first_expert_replica);
  return terms;
}

at::Tensor SquaredGradNormOnDevice(const Adapter& adapter, ProcessGroups* groups) {
  const at::Device device =
      adapter.parameters().empty() ? at::Device(at::kCPU) : adapter.parameters()[0].main_grad.device();
  return GroupSumsOfSquares({SquaredGradNormTerms(adapter, groups)}, device).select(0, 0);
}

namespace {

class Finalizer {
 public:
  Finalizer(Adapter* adapter, ProcessGroups* groups, const GradFinalizeOptions& options)
      : adapter_(adapter), groups_(groups), options_(options),
        faults_(options.faults == nullptr ? nullptr : options.faults->Begin(groups == nullptr ? 0 : groups->rank())),
        device_(adapter->parameters().empty() ? at::Device(at::kCPU)
                                              : adapter->parameters()[0].main_grad.device()) {}

  absl::StatusOr<GradFinalizeReport> Run() {
    if (groups_ != nullptr) {
      std::vector<PlannedBucket> plan = Plan();
      LORASTEP_RETURN_IF_ERROR(CheckPlan(plan));
      LORASTEP_RETURN_IF_ERROR(Reduce(plan));
      LORASTEP_RETURN_IF_ERROR(CheckBucketDigests(plan));
    }
    LORASTEP_RETURN_IF_ERROR(CheckFamilyDigests());
    LORASTEP_ASSIGN_OR_RETURN(report_.grad_norm, GlobalNorm());
    return report_;
  }

 private:
  // Records that parameter i was reduced over `kind`'s group this step; false if it already
  // was (the same sum twice doubles the gradient). One bit per communicator: with ep = 1
  // the expert groups are the data and stage groups.
  bool MarkReduced(int i, GroupKind kind) {
    if (groups_->layout().sizes().ep == 1 && kind == GroupKind::kExpertData) kind = GroupKind::kData;
    if (groups_->layout().sizes().ep == 1 && kind == GroupKind::kExpertStage) kind = GroupKind::kStage;
    const int bit = 1 << static_cast<int>(kind);
    if (adapter_->reductions(i) & bit) return false;
    adapter_->reductions(i) |= bit;
    return true;
  }

  absl::Status MarkAllReduced(const std::vector<int>& params, GroupKind kind) {
    for (int i : params) {
      if (!MarkReduced(i, kind)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "gradient of ", adapter_->parameters()[i].name, " (stage ", groups_->coords().pp,
            ") was reduced twice in one step over the ", GroupKindName(kind),
            " group; refusing the step, nothing was applied"));
      }
    }
    return absl::OkStatus();
  }

  // SUM over `kind`'s group, refusing a second reduction of any parameter in the step.
  absl::Status ReduceOnce(GroupKind kind, at::Tensor& flat, const std::vector<int>& params) {
    LORASTEP_RETURN_IF_ERROR(MarkAllReduced(params, kind));
    return groups_->group(kind).AllReduce(flat);
  }

  std::vector<int> ParamsOfRole(int role) const {
    std::vector<int> out;
    const auto& params = adapter_->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].role == role) out.push_back(static_cast<int>(i));
    }
    return out;
  }

  // The buckets reduced whole over one group, in reduction order; their sums are compared
  // within that group afterwards (CheckBucketDigests), the expert buckets' per family
  // (CheckFamilyDigests). The shared-outer factors are reduced just before the first expert
  // bucket.
  struct PlannedBucket {
    const char* name;
    GroupKind kind;
    std::vector<at::Tensor> grads;  // empty: not on this rank
    std::vector<int> params;
    bool expert_family = false;  // compared per fc1/fc2 family
  };
  std::vector<PlannedBucket> Plan() const {
    std::vector<PlannedBucket> plan;
    auto& params = adapter_->parameters();
    // The tied embedding's two copies (first and last stage) each hold part of its
    // gradient (lookup, LM head): Megatron's embedding-group all-reduce.
    PlannedBucket embedding{"embedding", GroupKind::kEmbedding, {}, {}};
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].tied_across_stages) {
        embedding.grads.push_back(params[i].main_grad);
        embedding.params.push_back(static_cast<int>(i));
      }
    }
    plan.push_back(std::move(embedding));
    const std::tuple<const char*, GradBucket, GroupKind> flat[] = {
        {"replicated_partial", GradBucket::kReplicatedPartial, GroupKind::kStage},
        {"expert_replicated_partial", GradBucket::kExpertReplicatedPartial, GroupKind::kExpertStage},
        {"expert_split", GradBucket::kExpertSplit, GroupKind::kExpertData},
        {"split", GradBucket::kSplit, GroupKind::kData},
        {"replicated_full", GradBucket::kReplicatedFull, GroupKind::kData}};
    for (const auto& [name, bucket, kind] : flat) {
      PlannedBucket b{name, kind, {}, ParamsOfRole(static_cast<int>(bucket)),
                      bucket == GradBucket::kExpertReplicatedPartial};
      if (at::Tensor t = adapter_->grad_bucket(bucket); t.defined()) b.grads.push_back(t);
      plan.push_back(std::move(b));
    }
    return plan;
  }

  // The reduction plan, before any gradient collective: every member of a bucket's group
  // must hold the same parameters (names and shapes, in order; the tied embedding's copies
  // are named differently on the first and last stage, so there only shapes), and every
  // rank of a stage the same shared-factor inventory (keys, whole shapes, the group), or
  // the collectives would pair up different tensors. One world all-gather of one SHA-256 per
  // bucket; a difference fails the step on every rank with nothing reduced.
  absl::Status CheckPlan(const std::vector<PlannedBucket>& plan) {
    const auto& params = adapter_->parameters();
    std::vector<std::pair<const char*, GroupKind>> checked;  // (bucket, group), in digest order
    std::vector<at::Tensor> words;
    std::string inventory;
    for (const SharedFactor& f : adapter_->shared_factors()) {
      absl::StrAppend(&inventory, f.key, " [", absl::StrJoin(f.shape, ","), "] stage{",
                      absl::StrJoin(groups_->group(GroupKind::kStage).ranks(), ","), "}\n");
    }
    if (faults_ != nullptr) inventory += faults_->PlanSuffix("shared-factor inventory");
    checked.push_back({"shared-factor inventory", GroupKind::kStage});
    words.push_back(DigestWords(inventory.empty() ? "" : StringSha256(inventory), device_));
    for (const PlannedBucket& b : plan) {
      std::string text = b.name;
      for (int i : b.params) {
        absl::StrAppend(&text, "\n", b.kind == GroupKind::kEmbedding ? "" : params[i].name, " [",
                        absl::StrJoin(params[i].value.sizes(), ","), "]");
      }
      if (faults_ != nullptr) text += faults_->PlanSuffix(b.name);
      checked.push_back({b.name, b.kind});
      words.push_back(DigestWords(StringSha256(text), device_));
    }
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> gathered,
                              groups_->group(GroupKind::kWorld).AllGather(at::cat(words)));
    std::vector<at::Tensor> per_rank;
    for (const auto& t : gathered) {
      per_rank.push_back(t.to(at::kCPU).view({static_cast<int64_t>(checked.size()), kDigestWords}));
    }
    for (size_t k = 0; k < checked.size(); ++k) {
      std::vector<at::Tensor> column;
      for (const auto& t : per_rank) column.push_back(t[k]);
      const auto bad = Disagreements(groups_->layout(), checked[k].second, column);
      if (bad.empty()) continue;
      if (k == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "shared expert LoRA factor inventory differs across replicas (", absl::StrJoin(bad, "; "),
            "); no gradient collective was issued and nothing was applied"));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "the reduction plan of the ", checked[k].first, " bucket differs within its ",
          GroupKindName(checked[k].second), " group (", absl::StrJoin(bad, "; "),
          "): its ranks would reduce different tensors together; no gradient collective was issued and "
          "nothing was applied"));
    }
    return absl::OkStatus();
  }

  absl::Status Reduce(std::vector<PlannedBucket>& plan) {
    for (PlannedBucket& b : plan) {
      if (b.expert_family) LORASTEP_RETURN_IF_ERROR(ReduceSharedFactors());
      if (b.grads.empty()) continue;
      for (int n = 0; n < Reductions(b.name); ++n) {
        if (b.grads.size() == 1) {
          LORASTEP_RETURN_IF_ERROR(ReduceOnce(b.kind, b.grads[0], b.params));
        } else {
          LORASTEP_RETURN_IF_ERROR(MarkAllReduced(b.params, b.kind));
          LORASTEP_RETURN_IF_ERROR(groups_->group(b.kind).AllReduceCoalesced(b.grads));
        }
      }
      if (faults_ != nullptr) faults_->AfterReduction(b.name, b.grads);
    }
    return absl::OkStatus();
  }

  // After the reductions every member of a bucket's group holds the same sums: one SHA-256
  // per bucket, all buckets in one world all-gather (a rank without the bucket, or a group of
  // one, sends -1s), compared within each group. Any difference fails the step on every rank.
  absl::Status CheckBucketDigests(std::vector<PlannedBucket> plan) {
    plan.erase(std::remove_if(plan.begin(), plan.end(), [](const PlannedBucket& b) { return b.expert_family; }),
               plan.end());
    const ParallelLayout& layout = groups_->layout();
    std::vector<at::Tensor> words;
    for (const PlannedBucket& b : plan) {
      const bool replicated = layout.Group(b.kind, 0).size() > 1 && !b.grads.empty();
      words.push_back(DigestWords(replicated ? TensorsSha256(b.grads) : "", device_));
    }
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> gathered,
                              groups_->group(GroupKind::kWorld).AllGather(at::cat(words)));
    std::vector<at::Tensor> per_rank;
    for (const auto& t : gathered) per_rank.push_back(t.to(at::kCPU).view({static_cast<int64_t>(plan.size()), kDigestWords}));
    for (size_t k = 0; k < plan.size(); ++k) {
      std::vector<at::Tensor> column;
      for (const auto& t : per_rank) column.push_back(t[k]);
      const auto bad = Disagreements(layout, plan[k].kind, column);
      if (bad.empty() || !CheckDigests()) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "post-reduction gradient digests of the ", plan[k].name, " bucket differ within its ",
          GroupKindName(plan[k].kind), " group (", absl::StrJoin(bad, "; "),
          "): a reduction was skipped or its result changed on a rank; refusing the step before the "
          "optimizer, nothing was applied"));
    }
    return absl::OkStatus();
  }

  // Shared-outer factors: per family, in key order, one coalesced SUM over the stage group.
  absl::Status ReduceSharedFactors() {
    if (!adapter_->shared_factors().empty()) {
      CommGroup& stage = groups_->group(GroupKind::kStage);
      LORASTEP_RETURN_IF_ERROR(SharedFactorGroupCheck(groups_->layout(), stage.ranks()));
      if (stage.ranks() != SharedFactorGroup(groups_->layout(), groups_->rank())) {
        return absl::InternalError("shared-factor group: the stage communicator's ranks differ from the layout's");
      }
    }
    for (const char* family : {"fc1", "fc2"}) {
      std::vector<at::Tensor> grads;
      std::vector<int> params;
      for (const SharedFactor& f : adapter_->shared_factors()) {
        if (f.family != family) continue;
        grads.push_back(adapter_->parameters()[f.param].main_grad);
        params.push_back(f.param);
      }
      if (grads.empty()) continue;
      for (int k = 0; k < Reductions(absl::StrCat("shared_", family)); ++k) {
        LORASTEP_RETURN_IF_ERROR(MarkAllReduced(params, GroupKind::kStage));
        LORASTEP_RETURN_IF_ERROR(groups_->group(GroupKind::kStage).AllReduceCoalesced(grads));
      }
    }
    return absl::OkStatus();
  }

  // One SHA-256 per present family of replicated expert factors, gathered over the world and
  // compared inside each replica group (stage for shared-outer, expert-stage for per-expert).
  absl::Status CheckFamilyDigests() {
    if (groups_ == nullptr || !options_.expert_lora) return absl::OkStatus();  // nothing to compare
    // Which replica group: shared factors are replicated over the stage, per-expert ones over
    // the expert-stage group (the same on every rank: one adapter config, one layout).
    const GroupKind kind = adapter_->lora_config().shared_outer() ? GroupKind::kStage : GroupKind::kExpertStage;
    if (groups_->layout().Group(kind, 0).size() < 2) return absl::OkStatus();
    for (const char* family : {"fc1", "fc2"}) {
      std::vector<at::Tensor> grads;
      std::vector<int> params;
      bool shared = false;
      const auto& all = adapter_->parameters();
      for (const SharedFactor& f : adapter_->shared_factors()) {
        if (f.family == family) {
          grads.push_back(all[f.param].main_grad);
          params.push_back(f.param);
          shared = true;
        }
      }
      for (size_t i = 0; i < all.size() && !shared; ++i) {
        if (all[i].role == kExpertReplicatedPartial && all[i].family == family) {
          grads.push_back(all[i].main_grad);
          params.push_back(static_cast<int>(i));
        }
      }
      const std::string name = absl::StrCat(shared ? "grad_shared_" : "grad_experts_", family);
      if (faults_ != nullptr && !grads.empty()) faults_->AfterReduction(name, grads);
      const std::string hex = grads.empty() ? "" : TensorsSha256(grads);
      if (!hex.empty()) report_.family_digests[name] = hex;
      // Every rank takes part (a rank without the family sends -1s), so all reach one verdict.
      LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> gathered,
                                groups_->group(GroupKind::kWorld).AllGather(DigestWords(hex, device_)));
      std::vector<at::Tensor> cpu;
      bool present = false;
      for (const auto& t : gathered) {
        cpu.push_back(t.to(at::kCPU));
        present = present || cpu.back()[0].item<double>() >= 0;
      }
      if (!present) continue;
      const auto bad = Disagreements(groups_->layout(), kind, cpu);
      if (!hex.empty()) report_.family_digests_agree[name] = bad.empty();
      if (!bad.empty() && CheckDigests()) {
        std::vector<std::string> names;
        for (int i : params) names.push_back(all[i].name);
        return absl::FailedPreconditionError(absl::StrCat(
            "post-reduction ", family, " gradient digests of the replicated expert LoRA factors "
            "differ (", absl::StrJoin(bad, "; "), "; factors on this rank: ",
            names.empty() ? std::string("none") : names.front(), names.size() > 1 ? " ..." : "",
            "); refusing the step before the optimizer, nothing was applied"));
      }
    }
    return absl::OkStatus();
  }

  int Reductions(const std::string& group) const { return faults_ == nullptr ? 1 : faults_->Reductions(group); }
  bool CheckDigests() const { return faults_ == nullptr || faults_->CheckDigests(); }

  // Squares of every distinct element, each counted by exactly one rank, summed over the world.
  absl::StatusOr<double> GlobalNorm() {
    at::Tensor sq = SquaredGradNormOnDevice(*adapter_, groups_).reshape({1});
    if (groups_ != nullptr) LORASTEP_RETURN_IF_ERROR(groups_->group(GroupKind::kWorld).AllReduce(sq));
    return std::sqrt(sq.item<double>());
  }

  Adapter* adapter_;
  ProcessGroups* groups_;
  const GradFinalizeOptions& options_;
  const std::unique_ptr<FinalizeFaults> faults_;  // null: none (production)
  const at::Device device_;
  GradFinalizeReport report_;
};

}  // namespace

absl::StatusOr<GradFinalizeReport> FinalizeStepGradients(Adapter* adapter, ProcessGroups* groups,
                                                         const GradFinalizeOptions& options) {
  return GuardTorch([&]() -> absl::StatusOr<GradFinalizeReport> {
    at::NoGradGuard no_grad;
    return Finalizer(adapter, groups, options).Run();
  });
}

}  // namespace lorastep
