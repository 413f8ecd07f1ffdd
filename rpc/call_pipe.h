// Calls over a connected Unix stream socket that a process shares with the child it spawned
// (the coordinator and its local worker): a request and its answer each travel as one frame,
// with no HTTP/2 framing, flow control or completion-queue threads in the way. Only the two
// processes hold the socket (it is inherited at spawn, never named in the filesystem), so
// nothing else can reach the calls it carries.
//
// A frame is a fixed little-endian header (magic, kind, method, flags, status code, call id,
// deadline, the lengths of a message and a payload) followed by the message and the payload.
// The reader checks the header's lengths against its limits before it reads the rest.
//
// The caller may share a memory region with the callee (a sealed memfd it passes over the
// socket in a first frame): a call's payload is then copied once into a span of the region
// and the frame carries only where it lies, instead of the kernel copying it into the socket
// and out again. The caller alone writes the region; a span is reused only once the callee
// has answered the call that used it, so the callee reads it in place until it answers.
#ifndef LORASTEP_RPC_CALL_PIPE_H_
#define LORASTEP_RPC_CALL_PIPE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lib/cancel_token.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rpc/answer_window.h"

namespace lorastep {

// The worker calls that travel over the coordinator's pipe (a training loop's per-step calls);
// every other call stays on gRPC.
enum class WorkerPipeMethod : uint8_t { kTrainStep = 1, kForwardBackward = 2, kForward = 3, kOptimStep = 4 };

// kRegion: the caller's shared region, its descriptor passed with the frame (SCM_RIGHTS).
enum class CallFrameKind : uint8_t { kCall = 1, kAnswer = 2, kCancel = 3, kRegion = 4 };

struct CallFrame {
  CallFrameKind kind = CallFrameKind::kCall;
  uint8_t method = 0;                              // kCall
  absl::StatusCode code = absl::StatusCode::kOk;   // kAnswer
  uint64_t call_id = 0;
  int64_t deadline_unix_us = 0;                    // kCall; 0: none
  std::string message;                             // kAnswer: a failure's message
  std::string payload;                             // kCall: the request; kAnswer (OK): the response
  // Written after `payload` as part of it (the reader gets one payload): bytes the writer
  // does not own and need not copy, valid until WriteCallFrame returns.
  std::vector<absl::string_view> payload_tail;
  // kCall: the payload lies in the caller's shared region at [region_offset, region_offset +
  // region_bytes) and `payload` is empty.
  bool payload_in_region = false;
  uint64_t region_offset = 0;
  uint64_t region_bytes = 0;
  // kRegion: the descriptor sent with the frame, or received with it (the reader owns and
  // closes it; descriptors that come with other frames are closed on arrival).
  int passed_fd = -1;
};

// A call's payload as the callee gets it: a buffer of its own, or a span of the caller's
// shared region, read in place (valid until the callee answers the call).
class CallPayload {
 public:
  CallPayload() = default;
  explicit CallPayload(std::string owned) : owned_(std::move(owned)) {}
  // `bytes` lies in the mapping `region` keeps alive.
  CallPayload(absl::string_view bytes, std::shared_ptr<const void> region)
      : shared_(bytes), region_(std::move(region)) {}
  absl::string_view bytes() const { return region_ ? shared_ : absl::string_view(owned_); }
  bool in_shared_region() const { return region_ != nullptr; }

 private:
  std::string owned_;
  absl::string_view shared_;
  std::shared_ptr<const void> region_;
};

// Writes the whole frame (the caller serializes writers of one socket). UNAVAILABLE when the
// peer has closed its end.
absl::Status WriteCallFrame(int fd, const CallFrame& frame);
// Reads one frame. UNAVAILABLE at the end of the stream (the peer closed or exited);
// DATA_LOSS for a header that is not a frame's; RESOURCE_EXHAUSTED for a payload over
// `max_payload_bytes` (nothing past the header is read then; the stream is out of step and
// the caller closes it).
absl::StatusOr<CallFrame> ReadCallFrame(int fd, uint64_t max_payload_bytes);

class CallPipeClient;

// The tail of a call's payload copied into the caller's shared region ahead of the call
// (CallPipeClient::Stage), by a thread that has the bytes at hand, with room before it for the
// call's own bytes. A call of the same client takes the span over; dropped untaken, it frees
// the span.
class StagedTail {
 public:
  ~StagedTail();
  StagedTail(const StagedTail&) = delete;
  StagedTail& operator=(const StagedTail&) = delete;

 private:
  friend class CallPipeClient;
  struct Place;
  explicit StagedTail(std::shared_ptr<Place> place) : place_(std::move(place)) {}
  std::shared_ptr<Place> place_;
};

// The caller's side: sends calls, and reads answers on the waiting callers' own threads (one
// of them reads at a time and hands each answer to its caller), so an answer wakes the thread
// that waits for it and no other. Thread-safe; calls from several threads are in flight
// together.
class CallPipeClient {
 public:
  // Owns `fd` (closed on destruction). `peer` names the callee in errors. `region_bytes` > 0:
  // shares a region of that size with the callee for call payloads (a payload that does not
  // fit in its free spans goes inline; so do all where the region cannot be made).
  CallPipeClient(int fd, std::string peer, uint64_t max_answer_bytes = 1ull << 30, uint64_t region_bytes = 0);
  // Closes the pipe; calls still waiting return UNAVAILABLE, and it waits for them to return.
  ~CallPipeClient();
  CallPipeClient(const CallPipeClient&) = delete;
  CallPipeClient& operator=(const CallPipeClient&) = delete;

  // Sends `payload` as a call of `method` and waits for the answer: its payload, or the
  // callee's status. At `deadline` the call returns DEADLINE_EXCEEDED and the callee is told to
  // cancel it (as it is told the deadline itself). UNAVAILABLE once the pipe has closed (the
  // callee exited). `payload_tail`: more of the payload, written after it uncopied (the
  // callee reads one payload); it need only outlive the write, which ends before the wait.
  // `staged`: `payload_tail` already copied into the region by Stage; the call copies only
  // `payload` in front of it (or, where that does not fit or `staged` is another client's or
  // already taken, copies the whole payload as without it).
  // `cancel`: when it is cancelled the call returns CANCELLED at once and the callee is told
  // to cancel it.
  absl::StatusOr<std::string> Call(uint8_t method, std::string payload,
                                   std::chrono::system_clock::time_point deadline,
                                   std::vector<absl::string_view> payload_tail = {},
                                   const StagedTail* staged = nullptr, CancelToken* cancel = nullptr);
  // Copies `tail` into the shared region now, with `front_bytes` free before it for the
  // payload of the call that will send it. Null without a region, for a tail smaller than
  // calls send through the region, or when no free span fits.
  std::shared_ptr<const StagedTail> Stage(uint64_t front_bytes, const std::vector<absl::string_view>& tail);
  // Every call in flight returns CANCELLED now; the callee is told to cancel each.
  void CancelAll();
  // The same for call `id` alone (Call's `cancel`).
  void Cancel(uint64_t id);
  // Whether calls' payloads go through a shared region.
  bool shares_region() const { return region_ != nullptr; }
  // The waiting caller polls the socket for its answer inside the window the answer is
  // expected in (the method's recent durations, rpc/answer_window.h) instead of sleeping
  // through it, and blocks before and after it. Off by default.
  void set_poll_for_answers(bool on) { poll_for_answers_ = on; }

 private:
  friend class StagedTail;
  class Region;
  struct Pending {
    bool done = false;
    absl::Status status;
    std::string payload;
    // Under mu_: its caller waits here, woken alone when its answer is handed over, when the
    // reader's turn passes to it, or when the pipe closes (many calls answered together
    // would otherwise wake every waiting caller once per answer).
    std::condition_variable handed;
  };
  // As the reader (reading_ held, `lock` released meanwhile): waits for a frame until
  // `deadline`, a wake-up (CancelAll, the destructor) or the opening of `window` (polling
  // inside it), reads it and hands it to its caller.
  void ReadAnswer(std::unique_lock<std::mutex>& lock, std::chrono::system_clock::time_point deadline,
                  const AnswerWindows::Window& window);
  void Close(const absl::Status& why);  // under mu_: every waiting call fails
  void HandOverReading();               // under mu_: a waiting caller, if any, takes the reader's turn
  void Wake();                          // the reader's wait returns
  void SendCancel(uint64_t call_id);    // best effort

  const int fd_;
  const int wake_fd_;  // an eventfd beside fd_ in the reader's poll
  const std::string peer_;
  const uint64_t max_answer_bytes_;
  std::mutex write_mu_;
  std::mutex mu_;
  std::condition_variable changed_;  // under mu_: a call left (the destructor waits for the last)
  bool reading_ = false;             // under mu_: a caller is reading the pipe
  int active_calls_ = 0;             // under mu_: threads inside Call (the destructor waits for them)
  bool closed_ = false;              // under mu_
  absl::Status closed_status_;       // under mu_: why
  uint64_t next_id_ = 1;             // under mu_
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;  // under mu_
  std::shared_ptr<Region> region_;                        // null: none (thread-safe; staged tails share it)
  std::atomic<bool> poll_for_answers_{false};
  AnswerWindows windows_;  // by method
};

// The callee's side: reads calls on its own thread and hands each to `handler`, which
// answers it exactly once through `respond`, from any thread, at any time (the answer is
// dropped if the pipe has closed meanwhile).
class CallPipeServer {
 public:
  using Respond = std::function<void(const absl::Status& status, std::string payload)>;
  // `cancelled` turns true once the caller cancels the call, its deadline passes, or the pipe
  // closes.
  // A payload in the caller's shared region is read in place: only until `respond` is called.
  using Handler = std::function<void(uint8_t method, CallPayload payload, std::function<bool()> cancelled,
                                     Respond respond)>;
  // Owns `fd`. Calls with payloads over `max_call_bytes`, a second region, and a payload
  // outside the region close the pipe (the caller's calls in flight then fail UNAVAILABLE).
  // `poll_after_answer` > 0: after each answer the reader polls for the next call this long
  // before it blocks again (a training loop calls again soon after each answer; a reader that
  // slept through the step would wake late).
  CallPipeServer(int fd, uint64_t max_call_bytes, Handler handler,
                 std::chrono::microseconds poll_after_answer = std::chrono::microseconds(0));
  // Stops reading and closes the pipe; answers still to come are dropped.
  ~CallPipeServer();
  CallPipeServer(const CallPipeServer&) = delete;
  CallPipeServer& operator=(const CallPipeServer&) = delete;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  std::thread reader_;
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_CALL_PIPE_H_
