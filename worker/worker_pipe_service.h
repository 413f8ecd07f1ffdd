// The worker's pipe adapter: the per-step calls (rpc/call_pipe.h's WorkerPipeMethod) that the
// coordinator which spawned this worker sends over the socket they share. Each runs as its
// gRPC twin does: parsed here, then on its run's queue of the device calls through
// WorkerCalls, counted and logged as a gRPC call of the same method. The pipe carries no
// token: only the two processes hold it.
#ifndef LORASTEP_WORKER_WORKER_PIPE_SERVICE_H_
#define LORASTEP_WORKER_WORKER_PIPE_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "rpc/call_pipe.h"
#include "rpc/server_runner.h"
#include "worker/worker_dispatch.h"

namespace lorastep {

class WorkerPipeService {
 public:
  // Serves the pipe at `fd` (the worker's --coordinator_pipe_fd) until destroyed; calls over
  // `max_call_bytes` close it. INVALID_ARGUMENT naming the flag when `fd` is not an open
  // socket. `dispatch` and `observers` outlive the service.
  // `poll_after_answer`: how long the pipe's reader polls for the next call after each answer
  // (CallPipeServer).
  static constexpr uint64_t kMaxCallBytes = 1ull << 30;  // as a worker's gRPC message limit
  static absl::StatusOr<std::unique_ptr<WorkerPipeService>> Start(
      int fd, WorkerDispatch* dispatch, const CallObservers* observers, uint64_t max_call_bytes = kMaxCallBytes,
      std::chrono::microseconds poll_after_answer = std::chrono::microseconds(0));

 private:
  WorkerPipeService(int fd, WorkerDispatch* dispatch, const CallObservers* observers, uint64_t max_call_bytes,
                    std::chrono::microseconds poll_after_answer);
  void Handle(uint8_t method, CallPayload payload, std::function<bool()> cancelled, CallPipeServer::Respond respond);
  // Parses `payload` as a Req (its packed datums, if any, left in the payload's bytes and
  // converted on the device queue), then runs `work(calls, req, datums, resp, cancelled)` on
  // its run's queue of device calls; `datums` is null when the request carries its own.
  template <typename Req, typename Resp, typename Work>
  void Run(const char* method, CallPayload payload, std::function<bool()> cancelled,
           CallPipeServer::Respond respond, Work work);

  WorkerDispatch* dispatch_;
  const CallObservers* observers_;
  CallPipeServer server_;  // last: its reader stops before the rest goes
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_PIPE_SERVICE_H_
