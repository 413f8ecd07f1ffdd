// What the worker's two adapters share: the gRPC service (WorkerService) and the pipe from
// the coordinator that spawned this worker (WorkerPipeService). Both run a call through the
// same WorkerCalls on the same executors, so a run's calls keep their order whichever way
// each arrives.
#ifndef LORASTEP_WORKER_WORKER_DISPATCH_H_
#define LORASTEP_WORKER_WORKER_DISPATCH_H_

#include <chrono>
#include <cstddef>

#include "lib/prometheus_registry.h"
#include "lib/run_tenant.h"
#include "rpc/serial_executor.h"
#include "worker/worker_calls.h"
#include "worker/worker_core.h"

namespace lorastep {

struct WorkerDispatch {
  // `metrics`: this rank's step figures (rpc/step_metrics.h), labelled by run; may be null.
  // `device_call_threads`: how many runs' calls may wait for the device at once (a run's
  // calls run one at a time, in order); co-scheduling joins only calls that wait together.
  // `device_call_spin`: how long a device-call thread polls for its run's next call after
  // each before it sleeps (KeyedExecutor).
  explicit WorkerDispatch(WorkerCore* core, PrometheusRegistry* metrics = nullptr, size_t device_call_threads = 64,
                          std::chrono::microseconds device_call_spin = std::chrono::microseconds(0))
      : calls(core, metrics), device_calls(device_call_threads, device_call_spin, TenantOfRun) {}

  WorkerCalls calls;
  KeyedExecutor device_calls;  // the device's calls, by tenant, then run (WorkerCore's lock orders the device)
  SerialExecutor files;        // AwaitSaved and the store's files: the disk, never the device
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_DISPATCH_H_
