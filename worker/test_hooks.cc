// The testing build's fault injection (worker/test_hooks.h).
#include "worker/test_hooks.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "lib/training/grad_faults.h"
#include "rpc/test_flags.h"

namespace lorastep {

namespace {

// The testing flags' faults: --test_refuse "CALL:RANK" (rank RANK's own checks of its first
// CALL fail before the call's vote, as a missing file, run or failed check there would;
// "AdamW:RANK": its first staged optimizer update fails, as an allocation would;
// "AdamWCommit:RANK": its first commit fails after the vote), and
// --test_autosave_write_delay_ms (background SaveStates wait that long: a slow disk).
class TestFlagFaults : public FaultPoints {
 public:
  TestFlagFaults(std::string refuse, std::chrono::milliseconds write_delay)
      : refuse_(std::move(refuse)), write_delay_(write_delay) {
    const size_t colon = refuse_.rfind(':');
    if (colon == std::string::npos) return;
    call_ = refuse_.substr(0, colon);
    rank_ = refuse_.substr(colon + 1);
    point_ = call_ == "AdamW" ? "AdamWStage" : call_ == "AdamWCommit" ? "AdamWCommit" : "Admit" + call_;
    point_ += ":" + rank_;
  }

  absl::Status At(absl::string_view point) override {
    if (write_delay_.count() > 0 && absl::StartsWith(point, "BackgroundWrite:")) {
      std::this_thread::sleep_for(write_delay_);
    }
    if (point_.empty() || point != point_ || refused_.exchange(true)) return absl::OkStatus();
    if (call_ == "AdamW") return absl::ResourceExhaustedError("test_refuse");
    if (call_ == "AdamWCommit") return absl::InternalError("test_refuse");
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank_, " refuses this ", call_, " (test_refuse)"));
  }

 private:
  const std::string refuse_;
  const std::chrono::milliseconds write_delay_;
  std::string call_, rank_, point_;
  std::atomic<bool> refused_{false};  // the one refusal was made (the process's first)
};

}  // namespace

absl::Status ApplyTestFlags(WorkerOptions* options) {
  // A fault in one gradient bucket's reduction (skipped, doubled, or corrupted on one rank),
  // which the finalizer must refuse before the optimizer; the first finalization of the
  // process only: every rank of a mesh finalizes the same step first.
  GradFaultSpec grad;
  LORASTEP_RETURN_IF_ERROR(ParseBucketFault(absl::GetFlag(FLAGS_test_grad_fault), "test_grad_fault", &grad));
  static const auto once = std::make_shared<std::atomic<bool>>(false);
  grad.once = once;
  // Shared-outer expert factors: skip one family's reduction, reduce twice, run without the
  // digest checks, corrupt one rank's family gradients, or alter one rank's factor inventory.
  grad.skip_shared_family = absl::GetFlag(FLAGS_test_skip_shared_reduction);
  if (auto n = absl::GetFlag(FLAGS_test_shared_reductions)) grad.shared_reductions = *n;
  grad.check_digests = absl::GetFlag(FLAGS_test_check_grad_digests) != 0;
  grad.corrupt_family_rank = absl::GetFlag(FLAGS_test_corrupt_main_grad_rank);
  grad.inventory_mismatch_rank = absl::GetFlag(FLAGS_test_inventory_mismatch_rank);
  options->finalize.faults = MakeGradFaults(grad);
  const std::string refuse = absl::GetFlag(FLAGS_test_refuse);
  const std::chrono::milliseconds write_delay(absl::GetFlag(FLAGS_test_autosave_write_delay_ms));
  if (!refuse.empty() || write_delay.count() > 0) options->faults = std::make_shared<TestFlagFaults>(refuse, write_delay);
  return absl::OkStatus();
}

}  // namespace lorastep
