// Named points where a testing build makes the core fail, or wait, as a real fault would (an
// allocation that runs out of memory, a rank that refuses a call on its own, a slow disk).
// The core receives one through its options: production builds give none (null), so no
// fault is compiled into their branches beyond the null check. Testing binaries build theirs
// from the --test_* flags (worker/test_hooks.cc); tests may pass their own.
#ifndef LORASTEP_LIB_FAULT_POINTS_H_
#define LORASTEP_LIB_FAULT_POINTS_H_

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace lorastep {

class FaultPoints {
 public:
  virtual ~FaultPoints() = default;
  // What the caller passing `point` meets there: OK to go on, or the fault's status. It may
  // also block (a slow disk, a long step). Called from any thread.
  virtual absl::Status At(absl::string_view point) = 0;
};

// The points the core passes (one list, so tests and the testing flags name the same):
//   "AdmitTrainStep", "AdmitForwardBackward", "AdmitForward", "AdmitOptimStep",
//   "AdmitCreateRun" (with init_from), "AdmitSaveState", "AdmitLoadState",
//   "AdmitExportAdapter": a rank's own checks before the call's vote;
//   "AdamWStage": a run's staged optimizer update (its allocation) before the commit vote;
//   "AdamWCommit": the commit after the vote;
//   "BackgroundWrite": before a background SaveState writes;
//   "CoscheduledStepBegan", "CoscheduledStepEnded": around a co-scheduled step's work.
inline absl::Status AtFaultPoint(FaultPoints* faults, absl::string_view point) {
  return faults == nullptr ? absl::OkStatus() : faults->At(point);
}

// Another injector's points with a rank added ("<point>:<rank>"): one injector serves every
// rank of a mesh, and each rank's core passes its own.
class RankedFaultPoints : public FaultPoints {
 public:
  RankedFaultPoints(std::shared_ptr<FaultPoints> inner, int rank) : inner_(std::move(inner)), rank_(rank) {}
  absl::Status At(absl::string_view point) override { return inner_->At(absl::StrCat(point, ":", rank_)); }

 private:
  std::shared_ptr<FaultPoints> inner_;
  int rank_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_FAULT_POINTS_H_
