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
//                              second seed's shared-outer factors, exactly once, with the
//                              fail-closed checks below
//       kExpertReplicatedPartial -> expert-stage group; kExpertSplit -> expert-data group
//       kSplit, kReplicatedFull  -> data group
//     then the global gradient norm: one world all-reduce in which every distinct element
//     is counted by exactly one rank, so every rank clips by the same factor.
//
// Fail-closed (the second seed): before any gradient collective, every rank all-gathers a
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

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "lib/model/adapter.h"
#include "lib/parallel/process_groups.h"
#include "lib/training/sums_of_squares.h"

namespace lorastep {

absl::Status FoldLocalGradients(Adapter* adapter);

struct GradFinalizeOptions {
  // Whether the model may hold routed-expert LoRA factors on any rank (a MoE model's LoRA).
  // Without them the family digests (two world all-gathers) are skipped, on every rank
  // alike; set from the model, never from what this rank happens to hold.
  bool expert_lora = true;
  // Test only: one fault in one bucket's reduction, on every rank (skip: the dense form of
  // the second seed's bug; double: reduced twice) or on `rank` alone (corrupt: its sums
  // changed after the reduction; plan: its reduction plan of the bucket differs). With `once`, only the first finalization that shares it
  // (a worker process shares one: every rank of a mesh finalizes the same step first, and
  // the next step shows the run unharmed); without, every finalization. Each is refused
  // before the optimizer. Parsed from "BUCKET:skip", "BUCKET:double" or
  // "BUCKET:corrupt:RANK" by ParseGradFault.
  struct Fault {
    std::string bucket;  // "embedding", "replicated_partial", "expert_replicated_partial", "expert_split",
                         // "split", "replicated_full"
    std::string kind;    // "skip", "double", "corrupt", "plan"
    int rank = -1;
    std::shared_ptr<std::atomic<bool>> once;  // set: spent by the first finalization
  } fault;
  // Test only, shared-outer factors: a family ("fc1", "fc2") whose reduction is skipped
  // (the seed: the optimizer then reads rank-local gradients), how many times the others
  // are reduced (2: a doubled reduction, refused), whether the digest checks run, a rank
  // whose main_grad is corrupted after the reduction, a rank whose inventory is altered.
  std::string skip_shared_family;
  int shared_reductions = 1;
  bool check_digests = true;
  int corrupt_main_grad_rank = -1;
  int inventory_mismatch_rank = -1;
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

// "BUCKET:skip|double", "BUCKET:corrupt|plan:RANK" (GradFinalizeOptions::Fault); INVALID_ARGUMENT naming
// `field` otherwise. Empty text: no fault.
absl::StatusOr<GradFinalizeOptions::Fault> ParseGradFault(const std::string& text, const std::string& field);

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
