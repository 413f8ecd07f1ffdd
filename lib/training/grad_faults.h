// Faults for the gradient finalizer's tests and the worker's testing build (testing targets
// only): one fault in one bucket's reduction, on every rank (skip: reduced not at all;
// double: reduced twice) or on one rank (corrupt: its sums changed after the reduction;
// plan: its reduction plan of the bucket differs), and the shared-outer expert factors'
// faults (a family's reduction skipped, every family reduced n times, one rank's family
// gradients corrupted before their digest, one rank's factor inventory altered, the digest
// checks off). Every one of them must be refused before the optimizer.
#ifndef LORASTEP_LIB_TRAINING_GRAD_FAULTS_H_
#define LORASTEP_LIB_TRAINING_GRAD_FAULTS_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/training/grad_finalizer.h"

namespace lorastep {

struct GradFaultSpec {
  // One bucket's fault: `bucket` one of FinalizeFaults::Reductions' buckets, `kind` "skip",
  // "double", "corrupt" or "plan"; `rank` for "corrupt" and "plan".
  std::string bucket, kind;
  int rank = -1;
  std::string skip_shared_family;  // "fc1" or "fc2": its reduction skipped
  int shared_reductions = 1;       // of each shared-outer family
  bool check_digests = true;
  int corrupt_family_rank = -1;     // this rank's replicated expert factor gradients, before their digest
  int inventory_mismatch_rank = -1;  // this rank's shared-factor inventory gains an entry
  // Only the first finalization that shares this flag has the bucket fault (a worker process
  // shares one: every rank of a mesh finalizes the same step first, and the next step shows
  // the run unharmed); null: every finalization. The shared-factor faults hold in every one.
  std::shared_ptr<std::atomic<bool>> once;

  bool empty() const {
    return bucket.empty() && skip_shared_family.empty() && shared_reductions == 1 && check_digests &&
           corrupt_family_rank < 0 && inventory_mismatch_rank < 0;
  }
};

// Parses "BUCKET:skip", "BUCKET:double", "BUCKET:corrupt:RANK" or "BUCKET:plan:RANK" into
// `spec`'s bucket fault; INVALID_ARGUMENT naming `field` otherwise. Empty text: no change.
absl::Status ParseBucketFault(const std::string& text, const std::string& field, GradFaultSpec* spec);

// The source of faults that does what `spec` says (null when it asks for nothing).
std::shared_ptr<FinalizeFaultSource> MakeGradFaults(const GradFaultSpec& spec);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_GRAD_FAULTS_H_
