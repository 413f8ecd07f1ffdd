#include "worker/worker_pipe_service.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lorastep {

absl::StatusOr<std::unique_ptr<WorkerPipeService>> WorkerPipeService::Start(int fd, WorkerDispatch* dispatch,
                                                                           const CallObservers* observers,
                                                                           uint64_t max_call_bytes) {
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator_pipe_fd: ", fd, " is not an open socket (the coordinator passes it when it spawns the worker)"));
  }
  fcntl(fd, F_SETFD, FD_CLOEXEC);  // nothing this worker starts holds it
  return std::unique_ptr<WorkerPipeService>(new WorkerPipeService(fd, dispatch, observers, max_call_bytes));
}

WorkerPipeService::WorkerPipeService(int fd, WorkerDispatch* dispatch, const CallObservers* observers,
                                     uint64_t max_call_bytes)
    : dispatch_(dispatch),
      observers_(observers),
      server_(fd, max_call_bytes,
              [this](uint8_t method, std::string payload, std::function<bool()> cancelled,
                     CallPipeServer::Respond respond) {
                Handle(method, std::move(payload), std::move(cancelled), std::move(respond));
              }) {}

template <typename Req, typename Resp, typename Work>
void WorkerPipeService::Run(const char* method, const std::string& payload, std::function<bool()> cancelled,
                            CallPipeServer::Respond respond, Work work) {
  const auto start = std::chrono::steady_clock::now();
  auto req = std::make_shared<Req>();
  if (!req->ParseFromString(payload)) {
    absl::Status bad = absl::InvalidArgumentError(
        absl::StrCat("request: does not parse as ", Req::descriptor()->full_name()));
    ObserveCall(*observers_, method, bad, 0, "", "");
    respond(bad, "");
    return;
  }
  const std::string run_id = req->run_id();
  // Captures no `this`: a task still queued when the service goes runs at the dispatch's end.
  dispatch_->device_calls.Submit(run_id, [dispatch = dispatch_, observers = observers_, method, start, req,
                                          cancelled = std::move(cancelled), respond = std::move(respond), work]() {
    Resp resp;
    const absl::Status s = work(&dispatch->calls, *req, &resp, cancelled);
    std::string answer;
    if (s.ok()) resp.SerializeToString(&answer);
    ObserveCall(*observers, method, s, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                req->run_id(), req->mesh().request_id());
    respond(s, std::move(answer));
  });
}

void WorkerPipeService::Handle(uint8_t method, std::string payload, std::function<bool()> cancelled,
                               CallPipeServer::Respond respond) {
  switch (static_cast<WorkerPipeMethod>(method)) {
    case WorkerPipeMethod::kTrainStep:
      return Run<v1::WorkerTrainStepRequest, v1::WorkerStepResponse>(
          "Worker/TrainStep", payload, std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, auto* resp, const auto& cancelled) {
            return calls->TrainStep(req, resp, nullptr, cancelled);
          });
    case WorkerPipeMethod::kForwardBackward:
      return Run<v1::WorkerForwardBackwardRequest, v1::WorkerForwardBackwardResponse>(
          "Worker/ForwardBackward", payload, std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, auto* resp, const auto& cancelled) {
            return calls->ForwardBackward(req, resp, nullptr, cancelled);
          });
    case WorkerPipeMethod::kForward:
      return Run<v1::WorkerForwardRequest, v1::WorkerForwardBackwardResponse>(
          "Worker/Forward", payload, std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, auto* resp, const auto& cancelled) {
            return calls->Forward(req, resp, nullptr, cancelled);
          });
    case WorkerPipeMethod::kOptimStep:
      return Run<v1::WorkerOptimStepRequest, v1::WorkerStepResponse>(
          "Worker/OptimStep", payload, std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, auto* resp, const auto&) { return calls->OptimStep(req, resp); });
  }
  respond(absl::InvalidArgumentError(absl::StrCat("method: ", static_cast<int>(method), " is not a pipe call")), "");
}

}  // namespace lorastep
