#include "server/in_process_worker_start.h"

namespace lorastep {

absl::StatusOr<std::unique_ptr<WorkerClient>> StartInProcessWorker(const InProcessWorkerSettings&) {
  return absl::FailedPreconditionError(
      "in_process_worker: this lorastep_coordinator has no worker inside (it does not link LibTorch); "
      "run lorastep_coordinator_with_worker, built beside it");
}

}  // namespace lorastep
