// The public Trainer API over gRPC: a thin adapter that hands each call to the Coordinator
// on an executor chosen by run id (calls on one run stay in arrival order; no gRPC thread
// blocks on training work) and converts statuses in rpc/grpc_status.
#ifndef LORASTEP_SERVER_COORDINATOR_SERVICE_H_
#define LORASTEP_SERVER_COORDINATOR_SERVICE_H_

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "lorastep/v1/trainer.grpc.pb.h"
#include "server/coordinator.h"
#include <map>
#include <mutex>

#include "lib/prometheus_registry.h"
#include "server/admission.h"
#include "server/api_keys.h"
#include "rpc/poller_warmth.h"
#include "rpc/serial_executor.h"

namespace lorastep {

// TrainStep, ForwardBackward and Forward are served raw: their request bytes are checked
// (the caller's key, then the number of datums on the wire) before they are parsed, so a
// request can cost the server no more than a small multiple of its size (a batch of a million
// one-token datums parses to about 90 times its bytes).
using TrainerServiceBase = v1::Trainer::WithRawCallbackMethod_TrainStep<
    v1::Trainer::WithRawCallbackMethod_ForwardBackward<v1::Trainer::WithRawCallbackMethod_Forward<
        v1::Trainer::CallbackService>>>;

class CoordinatorService final : public TrainerServiceBase {
 public:
  // The full paths of the methods served raw (rpc/server_runner.h's CallObservers).
  static std::set<std::string> RawMethods();

  // `metrics`: where lorastep_queue_depth (calls accepted and not yet answered) is kept.
  // `api_keys`: null = no authentication (every caller is an admin); else every call must
  // carry a known key, and a caller sees and calls only its own runs (admins: all).
  // `executor_spin`: how long an executor thread polls for the next call after each
  // (KeyedExecutor).
  explicit CoordinatorService(Coordinator* core, size_t executors = 4, PrometheusRegistry* metrics = nullptr,
                              const ApiKeys* api_keys = nullptr,
                              std::chrono::microseconds executor_spin = std::chrono::microseconds(0));
  // Bounded queues (server/admission.h): calls accepted and not yet answered and the bytes
  // of their requests, per API key first, then per run and in all; beyond them a call is
  // RESOURCE_EXHAUSTED at once, naming the limit, with retry advice. Call before serving;
  // `limits` must pass AdmissionLimits::Check.
  void SetAdmissionLimits(const AdmissionLimits& limits) {
    admission_ = std::make_unique<Admission>(limits, metrics_);
  }
  // The queue shares this service counts calls against (the Tinker front shares them: one
  // key's calls through either count together).
  Admission* admission() { return admission_.get(); }
  // Step records a WatchMetrics stream holds for a client that reads slower than steps are
  // made; beyond it the stream ends with RESOURCE_EXHAUSTED (--max_watch_backlog).
  void SetWatchBacklog(size_t records) { max_watch_backlog_ = records; }
  // After each answer, keeps the server's poller stirring for `window` (rpc/poller_warmth.h;
  // --grpc_poller_warm_us). Zero: off. Call before serving.
  void SetPollerWarmth(std::chrono::microseconds window) { warmth_ = std::make_unique<PollerWarmth>(window); }

  grpc::ServerUnaryReactor* CreateRun(grpc::CallbackServerContext* ctx,
                                      const v1::CreateRunRequest* req, v1::Run* resp) override;
  grpc::ServerUnaryReactor* DeleteRun(grpc::CallbackServerContext* ctx, const v1::DeleteRunRequest* req,
                                      v1::DeleteRunResponse* resp) override;
  grpc::ServerUnaryReactor* GetRun(grpc::CallbackServerContext* ctx, const v1::GetRunRequest* req,
                                   v1::Run* resp) override;
  grpc::ServerUnaryReactor* ListRuns(grpc::CallbackServerContext* ctx,
                                     const v1::ListRunsRequest* req,
                                     v1::ListRunsResponse* resp) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                    grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* ctx,
                                      const v1::OptimStepRequest* req,
                                      v1::StepResponse* resp) override;
  grpc::ServerUnaryReactor* TrainStep(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* SaveState(grpc::CallbackServerContext* ctx,
                                      const v1::SaveStateRequest* req,
                                      v1::SaveStateResponse* resp) override;
  grpc::ServerUnaryReactor* LoadState(grpc::CallbackServerContext* ctx,
                                      const v1::LoadStateRequest* req, v1::Run* resp) override;
  grpc::ServerUnaryReactor* ExportAdapter(grpc::CallbackServerContext* ctx,
                                          const v1::ExportAdapterRequest* req,
                                          v1::ExportAdapterResponse* resp) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx,
                                            const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                             const v1::DeleteCheckpointRequest* req,
                                             v1::DeleteCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* ctx, const v1::SampleRequest* req,
                                   v1::SampleResponse* resp) override;
  grpc::ServerUnaryReactor* GetStepMetrics(grpc::CallbackServerContext* ctx,
                                           const v1::GetStepMetricsRequest* req,
                                           v1::GetStepMetricsResponse* resp) override;
  grpc::ServerWriteReactor<v1::StepRecord>* WatchMetrics(
      grpc::CallbackServerContext* ctx, const v1::WatchMetricsRequest* req) override;
  // Reads the whole adapter (at most the upload limit), then stores it on the run's executor.
  grpc::ServerReadReactor<v1::UploadAdapterChunk>* UploadAdapter(grpc::CallbackServerContext* ctx,
                                                                 v1::UploadAdapterResponse* resp) override;
  // The most bytes one UploadAdapter may send (both files together); --max_upload_mb.
  void SetUploadLimit(int64_t bytes) { max_upload_bytes_ = bytes; }

 private:
  // Runs `call(caller, server run id)` (returning absl::StatusOr<Resp>) on the run's
  // executor and finishes with it. After authentication (and, when `run_scoped`, the
  // caller's access to the run).
  // `before_finish`: run after a successful call filled `*resp`, before the reactor finishes
  // (a raw method serializes its response there). `before_queue(server run id)`: run on
  // this thread once the call is admitted, before it is queued; its error refuses the call.
  template <typename Resp, typename Call>
  // `ticket`: the call's admission when the caller admitted it already with its bytes (a raw
  // method, before parsing); else the call is admitted here as a call of its key. `cancel`:
  // cancelled when the client's call is (made here when null); a call still queued then is
  // not started.
  grpc::ServerUnaryReactor* Defer(grpc::CallbackServerContext* ctx, const std::string& run_id,
                                  Resp* resp, Call call, bool run_scoped = true,
                                  std::function<void()> before_finish = nullptr,
                                  std::function<absl::Status(const std::string&)> before_queue = nullptr,
                                  AdmissionTicket ticket = AdmissionTicket(), std::shared_ptr<CancelToken> cancel = nullptr);
  // A raw method: authenticates, counts the datums on the wire, parses into a request it
  // owns, has the core stage its packed batch (Coordinator::StageBatch) while the bytes are
  // at hand, runs `call(caller, server run id, request)` like Defer and serializes the response.
  template <typename Req, typename Resp, typename Call>
  grpc::ServerUnaryReactor* DeferRaw(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer& raw_req,
                                     grpc::ByteBuffer* raw_resp, Call call);
  // A `before_queue` that claims the call's sequence id into `claim` (Coordinator::ClaimSequence).
  std::function<absl::Status(const std::string&)> ClaimBeforeQueue(int64_t sequence_id, const std::string& request_id,
                                                                    std::shared_ptr<Coordinator::SequenceClaim> claim);
  absl::StatusOr<Caller> Authenticate(grpc::CallbackServerContext* ctx) const;
  // Authenticates, translates the run id the caller names into the server's
  // (`server_id`, run_names.h) and checks the caller's access to that run.
  absl::StatusOr<Caller> Authorize(grpc::CallbackServerContext* ctx, const std::string& run_id,
                                   std::string* server_id);
  // NOT_FOUND naming `client_id` unless `caller` may use run `server_id`.
  absl::Status CheckRunAccess(const std::string& client_id, const std::string& server_id, const Caller& caller);
  grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx, const absl::Status& why);
  absl::Status CheckPathAccess(const char* field, const std::string& path, const Caller& caller);

  Coordinator* core_;
  const ApiKeys* api_keys_;
  PrometheusRegistry* metrics_;
  std::unique_ptr<Admission> admission_;  // calls and request bytes in flight
  size_t max_watch_backlog_ = 1024;
  int64_t max_upload_bytes_ = int64_t{512} << 20;
  friend class UploadAdapterReactor;
  std::unique_ptr<PollerWarmth> warmth_;  // null: off (outlives the executor's calls)
  KeyedExecutor executor_;  // per-run order, runs served in turn (last: joined first)
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_COORDINATOR_SERVICE_H_
