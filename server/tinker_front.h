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
// Checkpoints: tinker://<model>/weights/<name> is the SaveState checkpoint
// lorastep://<run>/tinker-weights.<name> (with a PEFT export beside it, <...>.peft, for the
// archive download); tinker://<model>/sampler_weights/<name> the PEFT export
// lorastep://<run>/tinker-sampler.<name>. A path is the caller's when its run is in the
// caller's namespace, whether or not the run still exists.
// Sampling: a sampling session samples a sampler checkpoint through its model's run, or the
// base model through a run of its own made for the session (<session>-base, rank 1).
#ifndef LORASTEP_SERVER_TINKER_FRONT_H_
#define LORASTEP_SERVER_TINKER_FRONT_H_

#include <chrono>
#include <deque>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "rpc/serial_executor.h"
#include "server/admission.h"
#include "server/api_keys.h"
#include "server/coordinator.h"
#include "lib/io/state_store.h"
#include "lib/prometheus_registry.h"
#include "server/tinker_futures.h"

namespace lorastep {

// One request as the HTTP server read it.
struct TinkerRequest {
  std::string method;  // GET, POST, DELETE
  std::string route;   // the path after /api/v1/, as sent
  std::map<std::string, std::string> query;
  std::string base_url;         // scheme://host as the client reached this server
  std::string body;             // decoded (zstd undone)
  std::string idempotency_key;  // X-Idempotency-Key: the same across one call's transport retries
};

struct TinkerFrontOptions {
  std::string model_name;          // the served base model, as the SDK names it
  int64_t max_context_length = 0;  // the model's positions
  double lora_alpha = 32;          // the SDK sends only a rank (--tinker_lora_alpha)
  std::chrono::milliseconds session_ttl{300000};  // 0: sessions never expire
  std::chrono::milliseconds gap_wait{10000};
  size_t max_early_per_model = 1024;  // --tinker_max_early_per_model
  size_t executors = 32;  // models with a call running at once (the worker co-schedules those of different runs)
  size_t sampling_executors = 16;  // asample calls in flight at once (the worker batches them)
  size_t ephemeral_samplers_kept = 8;  // per model: unnamed sampler saves kept on disk
  size_t max_sessions_per_owner = 256;  // live sessions of one key; beyond: RESOURCE_EXHAUSTED
  size_t samplers_per_session = 64;     // sampling sessions kept per session (the oldest go first)
  std::chrono::milliseconds archive_link_ttl{15 * 60 * 1000};
  // The state store, when this process shares the workers' (--state_dir): checkpoint lists,
  // deletes and archive downloads read it directly. Not owned; null: those routes are 404.
  const StateStore* store = nullptr;
  // Where lorastep_tinker_sessions and lorastep_tinker_held_polls are published (not owned; may be null).
  PrometheusRegistry* metrics = nullptr;
  TinkerFutureOptions futures;
};

class TinkerFront {
 public:
  // `api_keys`: null = no authentication (loopback only; every caller an admin).
  // `admission`: the coordinator's per-key queue shares (may be null); a future holds its
  // call's ticket until it is finished.
  TinkerFront(Coordinator* core, const ApiKeys* api_keys, Admission* admission, TinkerFrontOptions options);
  ~TinkerFront();  // finishes queued calls, then answers held polls

  // The caller of an X-API-Key value on `route`, checked before a body is read.
  // UNAUTHENTICATED when keys are configured and this one is missing or unknown. An archive
  // link (archive_download/<token>) needs no key: its token is the credential.
  absl::StatusOr<Caller> Authenticate(const std::string& route, const std::string& api_key) const;
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
    std::string base_run;                            // server run id sampling the base model
    std::deque<std::string> samplers;                // its sampling sessions, oldest first
    std::string idempotency_key, body_digest;        // of the create_session that made it
  };
  struct Sampler {
    std::string owner, session;
    std::string run;         // server run id it samples through
    std::string checkpoint;  // lorastep://<run>/<name>; empty: the base model
    std::string model_path;  // tinker:// path it was made from ("" for the base model)
    std::map<int64_t, std::string> samples;  // seq_id -> future, for replays
  };
  struct ArchiveLink {
    std::string folder;
    std::chrono::steady_clock::time_point until;
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
    std::deque<std::string> ephemeral;       // unnamed sampler saves on disk, oldest first
  };

  void Post(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  // A retried create_session (the same X-Idempotency-Key and body) gets the session it made.
  HttpAnswer CreateSession(const Caller& caller, const TinkerRequest& req);
  HttpAnswer Heartbeat(const Caller& caller, const std::string& body);
  void CreateModel(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  HttpAnswer GetInfo(const Caller& caller, const std::string& body);
  void ForwardBackward(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  void OptimStep(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  // Deletes the model's run after the calls queued before it (its checkpoints stay).
  void UnloadModel(const Caller& caller, const TinkerRequest& req, HttpReply reply);
  // tinker_front_state.cc: checkpoints.
  void SaveWeights(const Caller& caller, const TinkerRequest& req, bool for_sampler, AdmissionTicket ticket,
                   HttpReply reply);
  void LoadWeights(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  HttpAnswer WeightsInfo(const Caller& caller, const std::string& body);
  HttpAnswer TrainingRuns(const Caller& caller, const TinkerRequest& req);
  HttpAnswer DeleteCheckpoint(const Caller& caller, const TinkerRequest& req);
  HttpAnswer ArchiveDownload(const TinkerRequest& req);
  // tinker_front_sampling.cc.
  void CreateSamplingSession(const Caller& caller, const std::string& body, HttpReply reply);
  void ASample(const Caller& caller, const TinkerRequest& req, AdmissionTicket ticket, HttpReply reply);
  HttpAnswer GetSampler(const Caller& caller, const std::string& id);
  // GET sessions (the caller's live sessions, paged by limit / offset) and sessions/{id} (its
  // models and sampling sessions); another key's session is not found.
  HttpAnswer Sessions(const Caller& caller, const TinkerRequest& req);
  // A sampling session `id` over `checkpoint` of `run` (or the base model); under mu_.
  void AddSampler(const std::string& id, const Caller& caller, const std::string& session, const std::string& run,
                  const std::string& checkpoint, const std::string& model_path);

  // A model call's JSON body with its model_id, seq_id and the model's run (the caller's).
  struct ModelCall {
    nlohmann::json body;
    std::string model_id, run;
    int64_t seq = 0;
  };
  absl::StatusOr<ModelCall> ParseModelCall(const Caller& caller, const std::string& body);
  // Gives a core call of the model's call `seq` its exactly-once id ("tinker-seq-<seq>": a
  // retried call is answered from the run's record) and the run's next sequence id.
  template <typename Request>
  absl::Status Stamp(const std::string& run, int64_t seq, Request* req) {
    auto state = core_->GetRun(run);
    if (!state.ok()) return state.status();
    req->set_run_id(run);
    req->set_request_id("tinker-seq-" + std::to_string(seq));
    req->set_sequence_id(state->next_sequence_id());
    return absl::OkStatus();
  }
  // Whether run `run` exists and `caller` may use it (an admin may use any, but only one that exists).
  bool Reaches(const std::string& run, const Caller& caller);
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
  std::map<std::string, size_t> sessions_of_owner_;
  std::map<std::string, ModelQueue> models_;  // by server run id
  std::map<std::string, Sampler> samplers_;   // by sampling session id
  std::map<std::string, ArchiveLink> archive_links_;  // by token
  std::thread housekeeper_;
  KeyedExecutor sampling_executor_;  // asample calls, concurrently
  KeyedExecutor executor_;  // a model's calls in order; declared last: joined first
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_FRONT_H_
