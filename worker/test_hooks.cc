// The testing build's fault injection (worker/test_hooks.h).
#include "worker/test_hooks.h"

#include <atomic>
#include <chrono>
#include <memory>

#include "absl/flags/flag.h"
#include "lib/training/grad_finalizer.h"
#include "rpc/test_flags.h"

namespace lorastep {

absl::Status ApplyTestFlags(WorkerOptions* options) {
  // A fault in one gradient bucket's reduction (skipped, doubled, or corrupted on one rank),
  // which the finalizer must refuse before the optimizer.
  absl::StatusOr<GradFinalizeOptions::Fault> fault =
      ParseGradFault(absl::GetFlag(FLAGS_test_grad_fault), "test_grad_fault");
  if (!fault.ok()) return fault.status();
  options->finalize.fault = *fault;
  // The first finalization of the process only: every rank of a mesh finalizes the same step first.
  static const auto once = std::make_shared<std::atomic<bool>>(false);
  options->finalize.fault.once = once;
  // Shared-outer expert factors (the second seed): skip one family's reduction, reduce
  // twice, run without the digest checks, corrupt one rank's main_grad, or alter one rank's
  // factor inventory.
  options->finalize.skip_shared_family = absl::GetFlag(FLAGS_test_skip_shared_reduction);
  if (auto n = absl::GetFlag(FLAGS_test_shared_reductions)) options->finalize.shared_reductions = *n;
  options->finalize.check_digests = absl::GetFlag(FLAGS_test_check_grad_digests) != 0;
  options->finalize.corrupt_main_grad_rank = absl::GetFlag(FLAGS_test_corrupt_main_grad_rank);
  options->finalize.inventory_mismatch_rank = absl::GetFlag(FLAGS_test_inventory_mismatch_rank);
  options->test_background_write_delay = std::chrono::milliseconds(absl::GetFlag(FLAGS_test_autosave_write_delay_ms));
  options->test_refuse = absl::GetFlag(FLAGS_test_refuse);
  return absl::OkStatus();
}

}  // namespace lorastep
