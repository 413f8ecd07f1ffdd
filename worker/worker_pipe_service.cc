#include "worker/worker_pipe_service.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/hop_trace.h"
#include "rpc/packed_wire.h"
#include "rpc/serial_executor.h"

namespace lorastep {

absl::StatusOr<std::unique_ptr<WorkerPipeService>> WorkerPipeService::Start(
    int fd, WorkerDispatch* dispatch, const CallObservers* observers, uint64_t max_call_bytes,
    std::chrono::microseconds poll_after_answer) {
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator_pipe_fd: ", fd, " is not an open socket (the coordinator passes it when it spawns the worker)"));
  }
  fcntl(fd, F_SETFD, FD_CLOEXEC);  // nothing this worker starts holds it
  return std::unique_ptr<WorkerPipeService>(new WorkerPipeService(fd, dispatch, observers, max_call_bytes, poll_after_answer));
}

WorkerPipeService::WorkerPipeService(int fd, WorkerDispatch* dispatch, const CallObservers* observers,
                                     uint64_t max_call_bytes, std::chrono::microseconds poll_after_answer)
    : dispatch_(dispatch),
      observers_(observers),
      server_(fd, max_call_bytes,
              [this](uint8_t method, CallPayload payload, std::function<bool()> cancelled,
                     CallPipeServer::Respond respond) {
                Handle(method, std::move(payload), std::move(cancelled), std::move(respond));
              },
              poll_after_answer) {}

namespace {

// `payload` parsed into `req`; a packed_datums field stays in the payload's bytes (its own
// buffer or the coordinator's shared region), read by `*packed`, and is converted to datums
// where they lie (one pass instead of a copy into the message and another into the datums).
template <typename Req>
absl::Status ParsePipeRequest(CallPayload payload, Req* req, std::optional<PackedDatumsWire>* packed) {
  auto not_parsed = [] {
    return absl::InvalidArgumentError(absl::StrCat("request: does not parse as ", Req::descriptor()->full_name()));
  };
  auto parse = [req](absl::string_view bytes) {
    return bytes.size() <= static_cast<size_t>(INT_MAX) && req->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  };
  if constexpr (HasPackedDatums<Req>::value) {
    auto owner = std::make_shared<const CallPayload>(std::move(payload));
    absl::StatusOr<FieldCut> cut = ScanTopLevelFields({owner->bytes()}, Req::kPackedDatumsFieldNumber, CountedField{});
    if (!cut.ok()) return not_parsed();
    if (!cut->cut) return parse(owner->bytes()) ? absl::OkStatus() : not_parsed();
    if (!parse(cut->rest)) return not_parsed();
    absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read(std::move(cut->field), owner);
    if (!wire.ok()) return not_parsed();
    packed->emplace(*std::move(wire));
    return absl::OkStatus();
  } else {
    return parse(payload.bytes()) ? absl::OkStatus() : not_parsed();
  }
}

// A call's packed datums converted by two threads at once: the pipe's reader thread starts on
// them as soon as they are checked, and the device thread that runs the call joins in when it
// starts; each takes the next few datums until none are left, so neither waits on a fixed
// share the other has not finished. Checked first (on the reader thread); a batch the check
// refuses, or one not in one piece, is converted whole on the device thread, which then
// refuses it.
struct SharedConversion {
  static constexpr size_t kDatumsPerTake = 4;
  std::optional<PackedArrays> arrays;
  absl::StatusOr<PackedLayout> layout = absl::FailedPreconditionError("not shared");
  std::vector<Datum> datums;
  std::atomic<size_t> next{0};  // the first datum nobody has taken
  std::mutex mu;
  std::condition_variable all_done_cv;
  size_t converted = 0;  // under mu

  bool shared() const { return layout.ok(); }
  // Converts datums until none are left to take.
  void Help() {
    size_t mine = 0;
    for (size_t begin = next.fetch_add(kDatumsPerTake); begin < datums.size();
         begin = next.fetch_add(kDatumsPerTake)) {
      const size_t end = std::min(begin + kDatumsPerTake, datums.size());
      UnpackDatums(*arrays, *layout, begin, end, &datums);
      mine += end - begin;
    }
    std::lock_guard<std::mutex> lock(mu);
    converted += mine;
    if (converted == datums.size()) all_done_cv.notify_all();
  }
  // Helps, then waits for the other thread's last datums.
  void HelpAndWait() {
    Help();
    std::unique_lock<std::mutex> lock(mu);
    all_done_cv.wait(lock, [this] { return converted == datums.size(); });
  }
};

}  // namespace

template <typename Req, typename Resp, typename Work>
void WorkerPipeService::Run(const char* method, CallPayload payload, std::function<bool()> cancelled,
                            CallPipeServer::Respond respond, Work work) {
  const auto start = std::chrono::steady_clock::now();
  auto req = std::make_shared<Req>();
  auto packed = std::make_shared<std::optional<PackedDatumsWire>>();
  if (absl::Status bad = ParsePipeRequest(std::move(payload), req.get(), packed.get()); !bad.ok()) {
    ObserveCall(*observers_, method, bad, 0, "", "");
    respond(bad, "");
    return;
  }
  auto conversion = std::make_shared<SharedConversion>();
  if constexpr (HasPackedDatums<Req>::value) {
    if (packed->has_value() && req->datums().empty()) conversion->arrays = (*packed)->Arrays();
    if (conversion->arrays && !conversion->arrays->empty()) {
      conversion->layout = CheckPackedArrays(*conversion->arrays);
      conversion->datums.resize(conversion->arrays->lengths.size());
    }
  }
  const std::string run_id = req->run_id();
  // Captures no `this`: a task still queued when the service goes runs at the dispatch's end.
  dispatch_->device_calls.Submit(run_id, [dispatch = dispatch_, observers = observers_, method, start, req, packed,
                                          conversion, cancelled = std::move(cancelled), respond = std::move(respond),
                                          work]() {
    MarkHop("worker_call_started", req->run_id());
    AfterAnswerScope after_answer;  // the step's figures once the answer is written
    Resp resp;
    absl::StatusOr<std::vector<Datum>> whole = std::vector<Datum>();
    const std::vector<Datum>* datums = nullptr;  // none: the request carries its own
    if (conversion->shared()) {
      conversion->HelpAndWait();
      datums = &conversion->datums;
    } else if (packed->has_value()) {
      if constexpr (HasPackedDatums<Req>::value) whole = (*packed)->Datums(req->datums());
      if (whole.ok()) datums = &*whole;
    }
    const absl::Status s =
        !whole.ok() ? whole.status() : work(&dispatch->calls, *req, datums, &resp, cancelled);
    std::string answer;
    if (s.ok()) resp.SerializeToString(&answer);
    const auto end = std::chrono::steady_clock::now();
    MarkHop("worker_answer_out", req->run_id());
    respond(s, std::move(answer));  // then the metrics and the log line: the coordinator waits for the answer only
    ObserveCall(*observers, method, s, std::chrono::duration<double>(end - start).count(), req->run_id(),
                req->mesh().request_id(), end);
  });
  if (conversion->shared()) conversion->Help();
}

void WorkerPipeService::Handle(uint8_t method, CallPayload payload, std::function<bool()> cancelled,
                               CallPipeServer::Respond respond) {
  switch (static_cast<WorkerPipeMethod>(method)) {
    case WorkerPipeMethod::kTrainStep:
      return Run<v1::WorkerTrainStepRequest, v1::WorkerStepResponse>(
          "Worker/TrainStep", std::move(payload), std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, const auto* datums, auto* resp, const auto& cancelled) {
            return calls->TrainStep(req, resp, datums, cancelled);
          });
    case WorkerPipeMethod::kForwardBackward:
      return Run<v1::WorkerForwardBackwardRequest, v1::WorkerForwardBackwardResponse>(
          "Worker/ForwardBackward", std::move(payload), std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, const auto* datums, auto* resp, const auto& cancelled) {
            return calls->ForwardBackward(req, resp, datums, cancelled);
          });
    case WorkerPipeMethod::kForward:
      return Run<v1::WorkerForwardRequest, v1::WorkerForwardBackwardResponse>(
          "Worker/Forward", std::move(payload), std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, const auto* datums, auto* resp, const auto& cancelled) {
            return calls->Forward(req, resp, datums, cancelled);
          });
    case WorkerPipeMethod::kOptimStep:
      return Run<v1::WorkerOptimStepRequest, v1::WorkerStepResponse>(
          "Worker/OptimStep", std::move(payload), std::move(cancelled), std::move(respond),
          [](WorkerCalls* calls, const auto& req, const auto*, auto* resp, const auto&) {
            return calls->OptimStep(req, resp);
          });
  }
  respond(absl::InvalidArgumentError(absl::StrCat("method: ", static_cast<int>(method), " is not a pipe call")), "");
}

}  // namespace lorastep
