// The Tinker SDK's protocol over the coordinator's core: what a program written against the
// Tinker SDK sends (sessions, models, forward_backward / optim_step and their futures) turned
// into the Coordinator's own calls, with no run logic of its own. No HTTP here: the server
// (server/http_front_server.h) hands each request in and the answer back.
//
// Names: a session is "t<16 hex>"; its n-th training model is "<session>:train:<n>", the
// lorastep run "<session>-train-<n>" of the caller's key (the same run over gRPC).
// Order: a model's calls carry seq_id 1, 2, ...; they run in seq_id order whatever order they
// arrive in (the SDK posts the chunks of one forward_backward concurrently, the first last):
// an early call waits (at most `max_early_per_model`; its future is answered at once), and
// when the missing seq_id has not come within `gap_wait` the model goes on without it (a
// seq_id that comes after its successors ran is refused, category user). A call sent again
// with the same (model, seq_id) and body gets the first call's future; with another body, 400.
// Sessions expire `session_ttl` after their last heartbeat; their models are then deleted
// (saved checkpoints stay).
#ifndef LORASTEP_SERVER_TINKER_FRONT_H_
#define LORASTEP_SERVER_TINKER_FRONT_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "rpc/serial_executor.h"
#include "server/admission.h"
#include "server/api_keys.h"
#include "server/coordinator.h"
#include "server/tinker_futures.h"

namespace lorastep {

// One request as the HTTP server read it.
struct TinkerRequest {
  std::string method;  // GET, POST, DELETE
  std::string route;   // the path after /api/v1/, as sent
  std::map<std::string, std::string> query;
  std::string idempotency_key;  // X-Idempotency-Key
  std::string body;             // decoded (zstd undone)
};

struct TinkerFrontOptions {
  std::string model_name;          // the served base model, as the SDK names it
  int64_t max_context_length = 0;  // the model's positions
  double lora_alpha = 32;          // the SDK sends only a rank (--tinker_lora_alpha)
  std::chrono::milliseconds session_ttl{300000};  // 0: sessions never expire
  std::chrono::milliseconds gap_wait{10000};
  size_t max_early_per_model = 1024;
  size_t executors = 4;
  TinkerFutureOptions futures;
};

class TinkerFront {
 public:
  // `api_keys`: null = no authentication (loopback only; every caller an admin).
  // `admission`: the coordinator's per-key queue shares (may be null); a future holds its
  // call's ticket until it is finished.
  TinkerFront(Coordinator* core, const ApiKeys* api_keys, Admission* admission, TinkerFrontOptions options);
  ~TinkerFront();  // finishes queued calls, then answers held polls

  // The caller of an X-API-Key value, checked before a body is read. UNAUTHENTICATED when
  // keys are configured and this one is missing or unknown.
  absl::StatusOr<Caller> Authenticate(const std::string& api_key) const;
  // Admits one call of `caller` whose body is `bytes` long, before the body is read.
  absl::StatusOr<AdmissionTicket> Admit(const Caller& caller, int64_t bytes);
  // Serves one request; `reply` is called exactly once, on this thread or later on another.
  void Handle(const Caller& caller, TinkerRequest req, AdmissionTicket ticket, HttpReply reply);

  TinkerFutures& futures() { return futures_; }

 private:
  struct Session {
    std::string owner;
    std::chrono::steady_clock::time_point last_seen;
    std::map<int64_t, std::string> create_requests;  // model_seq_id -> the create_model future
  };
  struct Early {
    std::chrono::steady_clock::time_point arrived;
    std::function<void()> run;
  };
  struct Submitted {
    std::string body_digest;
    std::string request_id;
  };
  struct ModelQueue {
    bool known = false;  // made by create_model here (else first seen after a restart)
    int64_t next_seq = 1;
    std::map<int64_t, Early> early;
    std::map<int64_t, Submitted> submitted;  // the latest seq_ids, for replays
  };

  void Post(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  HttpAnswer CreateSession(const Caller& caller, const std::string& body);
  HttpAnswer Heartbeat(const Caller& caller, const std::string& body);
  void CreateModel(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  HttpAnswer GetInfo(const Caller& caller, const std::string& body);
  void ForwardBackward(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  void OptimStep(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);

  // The server's run id of model `model_id` once the caller may use it; NOT_FOUND otherwise.
  absl::StatusOr<std::string> ModelRun(const Caller& caller, const std::string& model_id);
  // Queues `work(run)` as call `seq_id` of the model with run `run`, in seq_id order, and
  // answers `reply` with its future's id (or the earlier one for a replay). `work` returns
  // the future's answer.
  void Sequenced(const Caller& caller, const std::string& run, int64_t seq_id, const std::string& body_digest,
                 AdmissionTicket ticket, std::function<HttpAnswer()> work, HttpReply reply);
  void Release(const std::string& run, ModelQueue& q);  // under mu_: dispatches what is next
  void Housekeep();  // gaps, expired sessions

  Coordinator* core_;
  const ApiKeys* api_keys_;
  Admission* admission_;
  const TinkerFrontOptions options_;
  TinkerFutures futures_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, Session> sessions_;
  std::map<std::string, ModelQueue> models_;  // by server run id
  std::thread housekeeper_;
  KeyedExecutor executor_;  // a model's calls in order; declared last: joined first
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_FRONT_H_
