// The one gradient-finalization point between backward and the optimizer, in two parts:
//
//  1. FoldLocalGradients, after each backward (local, no communication): autograd-visible
//     gradients (the unfused path, and parameters without a custom backward: embeddings,
//     norms, biases) are added into each Parameter's fp32 main_grad exactly once and cleared.
//  2. FinalizeStepGradients, once per optimizer step (collective; every rank of the mesh
//     calls it in the same order), reducing each bucket over the group its role names:
//       tied embedding      -> embedding group
//       kReplicatedPartial  -> stage (tensor+data) group: the dense LoRA factors on the
//                              unsplit side of a split linear
//       kSharedExpert       -> stage group, per family (fc1, fc2), factors in key order: the
//                              shared-outer factors, exactly once, with the fail-closed
//                              checks below
//       kExpertReplicatedPartial -> expert-stage group; kExpertSplit -> expert-data group
//       kSplit, kReplicatedFull  -> data group
//     then the global gradient norm: one world all-reduce in which every distinct element
//     is counted by exactly one rank, so every rank clips by the same factor.
//
// Fail-closed: before any gradient collective, every rank all-gathers a
// SHA-256 of its reduction plan per bucket (the parameters' names and shapes in order) and
// of its ordered shared-factor inventory (key, whole shape, reduction group), and the step
// fails if two members of a bucket's group (of a stage, for the inventory) disagree. After the reductions every member of a
// bucket's reduction group holds the same sums, so every rank all-gathers one SHA-256 per
// reduced bucket (embedding, replicated_partial, expert_split, split, replicated_full: one
// world all-gather for all of them) and one per present fc1/fc2 family of replicated expert
// factors; any difference inside a group fails the step. A parameter reduced twice over
// one communicator in a step fails it too (the expert groups are the data and stage groups
// when ep = 1, and count as those). Failures are FAILED_PRECONDITION naming the factor, stage and ranks; the
// verdict is computed from world-gathered evidence, so every rank fails together and the
// trainer applies nothing.
//
// With k ForwardBackward calls before one OptimStep, part 1 runs k times and part 2 once:
// the reductions never repeat.
#ifndef LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_
#define LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/model/adapter.h"
#include "lib/parallel/process_groups.h"
#include "lib/training/sums_of_squares.h"

namespace lorastep {

absl::Status FoldLocalGradients(Adapter* adapter);

// Faults a test injects into one finalization, at the points the finalizer names; the
// finalizer asks and does as told. Production passes none (GradFinalizeOptions::faults).
// Implementations: lib/training/grad_faults.h (testing targets only).
class FinalizeFaults {
 public:
  virtual ~FinalizeFaults() = default;
  // How many times `group` is reduced: a bucket ("embedding", "replicated_partial",
  // "expert_replicated_partial", "expert_split", "split", "replicated_full") or a family of
  // shared-outer expert factors ("shared_fc1", "shared_fc2"). Normally 1.
  virtual int Reductions(const std::string& group) { return 1; }
  // Appended to this rank's reduction-plan text of a bucket, or of "shared-factor inventory".
  virtual std::string PlanSuffix(const std::string& bucket) { return ""; }
  // This rank's sums of a bucket after its reduction, or of a family of replicated expert
  // factors before their digest ("grad_shared_fc1", "grad_experts_fc2", ...): a test may
  // change them.
  virtual void AfterReduction(const std::string& group, std::vector<at::Tensor>& grads) {}
  // Whether differing post-reduction digests refuse the step (false: a test that shows what
  // goes wrong without the check).
  virtual bool CheckDigests() { return true; }
};

class FinalizeFaultSource {
 public:
  virtual ~FinalizeFaultSource() = default;
  // The faults of one finalization on rank `rank` (null: none), as it begins; from any thread.
  virtual std::unique_ptr<FinalizeFaults> Begin(int rank) = 0;
};

struct GradFinalizeOptions {
  // Whether the model may hold routed-expert LoRA factors on any rank (a MoE model's LoRA).
  // Without them the family digests (two world all-gathers) are skipped, on every rank
  // alike; set from the model, never from what this rank happens to hold.
  bool expert_lora = true;
  std::shared_ptr<FinalizeFaultSource> faults;  // null: none
};

// Evidence of one finalization, for the step's metrics.
struct GradFinalizeReport {
  double grad_norm = 0;
  // Per family of replicated expert factors present on this rank ("grad_shared_fc1",
  // "grad_shared_fc2" for shared-outer, "grad_experts_fc1", "grad_experts_fc2" per-expert):
  // whether every replica group agreed on the post-reduction gradient digest, and this
  // rank's digest (compared again by the coordinator, see ReplicaFamilyScope).
  std::map<std::string, bool> family_digests_agree;
  std::map<std::string, std::string> family_digests;
};

// This rank's share of the squared global gradient norm (each distinct element counted by
// one rank), an fp64 scalar left on the device: no host wait, no communication. World size 1
// (`groups` null): the whole squared norm, summed as FinalizeStepGradients sums it.
at::Tensor SquaredGradNormOnDevice(const Adapter& adapter, ProcessGroups* groups);

// The terms of SquaredGradNormOnDevice (GroupSumsOfSquares of one group of them is its
// value), for summing several adapters' norms in one pass.
std::vector<SquareTerm> SquaredGradNormTerms(const Adapter& adapter, ProcessGroups* groups);

// `groups` null = world size 1 (no communication). The norm is identical on every rank.
absl::StatusOr<GradFinalizeReport> FinalizeStepGradients(Adapter* adapter, ProcessGroups* groups,
                                                         const GradFinalizeOptions& options = {});

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_GRAD_FINALIZER_H_
