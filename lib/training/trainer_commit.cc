// The mesh transaction of a call: the votes every collective path casts (admission, outcome,
// cancellation), and the optimizer's staged commit with its replica digests. Members of
// Trainer (lib/training/trainer.h).
#include <ATen/ATen.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/io/digest.h"
#include "lib/status_macros.h"
#include "lib/torch_status.h"
#include "lib/training/grad_finalizer.h"
#include "lib/training/trainer.h"

namespace lorastep {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

absl::StatusOr<bool> Trainer::CallCancelled(const BatchOptions& batch) {
  if (!batch.cancelled) return false;
  if (options_.groups == nullptr) return batch.cancelled();
  if (!batch.agree_on_cancel) return false;
  // Every rank asks at the same micro-batch; any rank's yes stops them all there.
  return AnyMemberSaysYes(options_.groups->group(GroupKind::kWorld), base_->device, batch.cancelled());
}

absl::StatusOr<bool> AnyMemberSaysYes(CommGroup& group, const at::Device& device, bool yes) {
  at::Tensor any = at::full({1}, yes ? 1.0f : 0.0f, at::TensorOptions().device(device).dtype(at::kFloat));
  LORASTEP_RETURN_IF_ERROR(group.AllReduce(any, ReduceKind::kMax));
  return any.item<float>() > 0;
}

absl::Status AgreeOnMesh(ProcessGroups* groups, const at::Device& device, const absl::Status& local) {
  if (groups == nullptr) return local;
  return GuardTorch([&]() -> absl::Status {
    at::Tensor ok = at::full({1}, local.ok() ? 1.0f : 0.0f, at::TensorOptions().device(device).dtype(at::kFloat));
    absl::Status vote = groups->group(GroupKind::kWorld).AllReduce(ok, ReduceKind::kMin);
    if (!local.ok()) return local;
    if (!vote.ok()) return vote;
    if (ok.item<float>() < 1.0f) {
      return absl::AbortedError(absl::StrCat("rank ", groups->rank(),
                                             ": another rank of the mesh failed this call; "
                                             "nothing was applied"));
    }
    return absl::OkStatus();
  });
}

absl::Status Trainer::AgreeOnOutcome(const absl::Status& local) {
  return AgreeOnMesh(options_.groups, base_->device, local);
}

absl::StatusOr<OptimStepResult> Trainer::OptimStep(const AdamWParams& params) {
  return StepOptimizer(params, /*restore_on_failure=*/true);
}

void Trainer::AtStageFaultPoint(absl::StatusOr<AdamW::StagedStep>* staged) {
  if (!staged->ok()) return;
  if (absl::Status fault = AtFaultPoint(options_.faults, "AdamWStage"); !fault.ok()) {
    *staged = absl::ResourceExhaustedError(
        absl::StrCat("optimizer: the staged update could not be allocated (", fault.message(), ")"));
  }
}

absl::StatusOr<OptimStepResult> Trainer::StepOptimizer(const AdamWParams& params,
                                                       bool restore_on_failure, bool digest) {
  absl::Status local = ValidateAdamWParams(params);
  OptimStepResult result;
  auto t0 = Clock::now();
  if (local.ok()) local = FoldLocalGradients(adapter_.get());
  // On a mesh the reduction rewrites main_grad: keep the local gradients so a step refused
  // after it (non-finite norm, a peer's failure) leaves them as they were.
  const bool restore = restore_on_failure && options_.groups != nullptr;
  absl::StatusOr<CallSnapshot> taken =
      !local.ok() ? absl::StatusOr<CallSnapshot>(local) : restore ? Snapshot() : CallSnapshot{};
  // Admission: all ranks vote before the first gradient collective.
  LORASTEP_RETURN_IF_ERROR(AgreeOnOutcome(taken.status()));
  const CallSnapshot snapshot = *std::move(taken);
  GradFinalizeOptions finalize = options_.finalize;
  finalize.expert_lora = base_->config.is_moe() && !adapter_->full_finetune();
  auto finalized = FinalizeStepGradients(adapter_.get(), options_.groups, finalize);
  // Every rank stages its update aside (every allocation, and the check that each parameter
  // stays finite in its dtype), then the world votes: all commit it or none does.
  absl::StatusOr<AdamW::StagedStep> staged =
      finalized.ok() ? GuardTorch([&] { return optimizer_->Stage(params, finalized->grad_norm); })
                     : absl::StatusOr<AdamW::StagedStep>(finalized.status());
  AtStageFaultPoint(&staged);
  if (absl::Status agreed = AgreeOnOutcome(staged.status()); !agreed.ok()) {
    if (restore) Restore(snapshot);
    return agreed;
  }
  SyncDevice();
  result.metrics.Add("time_grad_finalize_s:sum", SecondsSince(t0));
  t0 = Clock::now();
  // The commit copies the staged state into place and allocates nothing; a failure here,
  // after the vote, is DATA_LOSS: the other ranks committed, so the run's copies differ (the
  // coordinator restores the run from its autosave).
  const absl::Status commit_fault = AtFaultPoint(options_.faults, "AdamWCommit");
  auto step = !commit_fault.ok() ? absl::StatusOr<OptimizerStepResult>(absl::InternalError(absl::StrCat(
                                       "the commit failed (", commit_fault.message(), ")")))
                                 : GuardTorch([&]() -> absl::StatusOr<OptimizerStepResult> {
                                     return optimizer_->Commit(*std::move(staged));
                                   });
  if (!step.ok()) {
    return absl::DataLossError(absl::StrCat("optimizer: the step failed after the mesh's commit vote",
                                            options_.groups != nullptr ? absl::StrCat(" on rank ", options_.groups->rank()) : "",
                                            " (", step.status().message(),
                                            "); this copy of the run may differ from its replicas"));
  }
  SyncDevice();
  result.metrics.Add("time_optimizer_s:sum", SecondsSince(t0));
  result.metrics.Add("grad_norm:sum", step->grad_norm);
  result.metrics.Add("lr:sum", step->lr);
  for (const auto& [family, agree] : finalized->family_digests_agree) {
    result.metrics.Add(absl::StrCat(family, "_digests_agree:mean"), agree ? 1.0 : 0.0, 1.0);
  }
  pending_backward_calls_ = 0;
  result.learner_version = optimizer_->steps_taken();
  const bool mesh = options_.groups != nullptr && options_.groups->layout().world_size() > 1;
  if (mesh || (digest && (!adapter_->full_finetune() || options_.digest_full_finetune_steps))) {
    t0 = Clock::now();
    const std::string local_sha = AdapterSha256();
    if (mesh) {  // one copy has nothing to compare
      result.replica_digests = ReplicaDigests(local_sha);
      for (const auto& [family, sha] : finalized->family_digests) result.replica_digests[family] = sha;
    }
    // The reported adapter digest is of whole tensors, the same at every layout.
    const bool sliced = options_.groups != nullptr && !base_->shard.whole();
    result.adapter_sha256 = !sliced ? local_sha : adapter_->full_finetune() ? "" : FullAdapterSha256();
    result.metrics.Add("time_digest_s:sum", SecondsSince(t0));
  }
  return result;
}

std::map<std::string, std::string> Trainer::ReplicaDigests(const std::string& trainable_sha256) const {
  // Each family is compared over the ranks that must hold equal copies of it (see
  // ReplicaFamilyScope): routed-expert factors only among holders of the same experts.
  std::map<std::string, std::vector<at::Tensor>> families;
  bool any_expert = false;
  // The tensor-replicated families are compared across tensor ranks; with one tensor rank
  // they are a subset of "trainable" (compared across replicas): not hashed twice.
  const int tp = base_->shard.tp;
  for (const Parameter& p : adapter_->parameters()) {
    if (p.role == kSharedExpert) {
      families["shared_" + p.family].push_back(p.value);
    } else if (p.expert_split) {
      any_expert = true;
      families["experts"].push_back(p.value);
      if (p.role == kExpertReplicatedPartial && tp > 1) families["experts_tensor_replicated"].push_back(p.value);
    } else {
      families["trainable"].push_back(p.value);
      if (TensorReplicated(p.role) && tp > 1) families["tensor_replicated"].push_back(p.value);
    }
  }
  std::map<std::string, std::string> digests;
  for (const auto& [family, tensors] : families) {
    const bool all = family == "trainable" && !any_expert && !families.count("shared_fc1") &&
                     !families.count("shared_fc2");
    digests[family] = all ? trainable_sha256 : TensorsSha256(tensors);
  }
  if (digests.empty()) digests["trainable"] = trainable_sha256;
  return digests;
}

}  // namespace lorastep
