// --in_process_worker: the worker inside the coordinator's process. Two implementations, one
// per binary: in_process_worker_start.cc in lorastep_coordinator_with_worker, which links
// LibTorch and the worker core; no_in_process_worker.cc in lorastep_coordinator, which stays
// LibTorch-free (a coordinator of remote workers needs no CUDA libraries) and says which
// binary has the worker.
#ifndef LORASTEP_SERVER_IN_PROCESS_WORKER_START_H_
#define LORASTEP_SERVER_IN_PROCESS_WORKER_START_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/worker_client.h"

namespace lorastep {

// The coordinator's flags that a lorastep_worker process would get.
struct InProcessWorkerSettings {
  std::string model, device, dtype, state_dir;
  std::optional<int64_t> max_tokens_per_microbatch;
  bool unfused_wgrad = false;
  bool pack_sequences = true;
  std::optional<double> max_activation_mb;
  std::string activation_recompute = "auto";
  int64_t coschedule_window_us = 5000;  // WorkerOptions::coschedule_window
  int cpu_threads = 0;
};

absl::StatusOr<std::unique_ptr<WorkerClient>> StartInProcessWorker(const InProcessWorkerSettings& settings);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_IN_PROCESS_WORKER_START_H_
