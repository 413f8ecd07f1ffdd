// C++ client of the lorastep Trainer API.
//
// TrainerClient makes single calls (absl::Status errors). RunSession wraps one run for an
// orchestrator loop: it fills request_id and sequence_id, and retries transient failures
// (UNAVAILABLE, DEADLINE_EXCEEDED) with the same request_id, which the server applies once.
//
// Example:
//   ASSIGN_OR_RETURN(auto client, TrainerClient::Connect("127.0.0.1:50051"));
//   ASSIGN_OR_RETURN(RunSession run, RunSession::Create(client.get(), lora, /*seed=*/0));
//   ASSIGN_OR_RETURN(v1::StepResponse step, run.TrainStep(datums, loss, adamw));
//
// Thread-safety: TrainerClient is thread-safe; a RunSession is not (calls on a run are
// sequential by contract).
#ifndef LORASTEP_CLIENTS_CPP_TRAINER_CLIENT_H_
#define LORASTEP_CLIENTS_CPP_TRAINER_CLIENT_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include <functional>

#include <grpcpp/support/byte_buffer.h>

#include "lorastep/v1/trainer.grpc.pb.h"
#include "rpc/answer_window.h"

namespace lorastep {

class TrainerClient {
 public:
  // `api_key`: for coordinators started with --api_keys_file (sent as "authorization:
  // Bearer <key>" on every call).
  // `ca_pem`: the CA certificate (PEM) of a coordinator serving TLS; empty = plaintext.
  static absl::StatusOr<std::unique_ptr<TrainerClient>> Connect(const std::string& address,
                                                                int timeout_seconds = 30,
                                                                const std::string& api_key = "",
                                                                const std::string& ca_pem = "");

  absl::StatusOr<v1::Run> CreateRun(const v1::CreateRunRequest& req);
  absl::StatusOr<v1::Run> GetRun(const std::string& run_id);
  absl::Status DeleteRun(const std::string& run_id);
  absl::StatusOr<v1::ListRunsResponse> ListRuns();
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(const v1::ForwardBackwardRequest& req);
  absl::StatusOr<v1::ForwardBackwardResponse> Forward(const v1::ForwardRequest& req);
  absl::StatusOr<v1::StepResponse> OptimStep(const v1::OptimStepRequest& req);
  absl::StatusOr<v1::StepResponse> TrainStep(const v1::TrainStepRequest& req);
  // The same call with its datums packed beside the request (`req` carries none): the arrays
  // go out from where `packed` holds them instead of copied into one serialized message.
  absl::StatusOr<v1::StepResponse> TrainStep(const v1::TrainStepRequest& req, const v1::PackedDatums& packed);
  absl::StatusOr<v1::SaveStateResponse> SaveState(const v1::SaveStateRequest& req);
  absl::StatusOr<v1::Run> LoadState(const v1::LoadStateRequest& req);
  absl::StatusOr<v1::ExportAdapterResponse> ExportAdapter(const v1::ExportAdapterRequest& req);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& req);
  absl::StatusOr<v1::DeleteCheckpointResponse> DeleteCheckpoint(const v1::DeleteCheckpointRequest& req);
  absl::StatusOr<v1::GetStepMetricsResponse> GetStepMetrics(const v1::GetStepMetricsRequest& req);
  // Completions of prompts from the run's current adapter (or the base model), ordered after
  // the run's earlier calls.
  absl::StatusOr<v1::SampleResponse> Sample(const v1::SampleRequest& req);
  // Streams step records to `on_record` until it returns false or the stream ends.
  absl::Status WatchMetrics(const v1::WatchMetricsRequest& req,
                            const std::function<bool(const v1::StepRecord&)>& on_record);
  // grpc.health.v1 status of the server ("" = overall): true when SERVING.
  absl::StatusOr<bool> Healthy();

  // The per-step calls (TrainStep, ForwardBackward, Forward, OptimStep) poll the connection
  // for their answer from the calling thread inside the window the answer is expected in
  // (rpc/answer_window.h), and block before and after it: a thread that slept through a
  // training step wakes late. The cost is at most that window (20 ms) of one core per call.
  // On by default; false: they block throughout, as every other call does.
  void set_poll_for_answers(bool on) { poll_for_answers_ = on; }

 private:
  TrainerClient(std::shared_ptr<grpc::Channel> channel, std::string authorization);
  // One per-step call of `method` (`kind`: which of the four, for its answer window) with the
  // serialized `request`, on a completion queue of its own, waited for as
  // set_poll_for_answers says; the response deserialized into a `Resp`.
  template <typename Resp>
  absl::StatusOr<Resp> StepCall(int kind, const char* method, const grpc::ByteBuffer& request);
  template <typename Resp, typename Req>
  absl::StatusOr<Resp> StepCall(int kind, const char* method, const Req& req);
  std::shared_ptr<grpc::Channel> channel_;
  std::string authorization_;  // "Bearer <key>" or empty
  std::unique_ptr<v1::Trainer::Stub> stub_;
  std::atomic<bool> poll_for_answers_{true};
  AnswerWindows windows_;  // by the kind of step call
};

// A random 128-bit hex id for request_id.
std::string NewRequestId();

class RunSession {
 public:
  static absl::StatusOr<RunSession> Create(TrainerClient* client, const v1::LoraConfig& lora,
                                           uint64_t seed, const std::string& run_id = "");
  // Continues an existing run from its current next_sequence_id.
  static absl::StatusOr<RunSession> Attach(TrainerClient* client, const std::string& run_id);

  const std::string& run_id() const { return run_id_; }
  int64_t next_sequence_id() const { return next_sequence_id_; }

  // `batch_totals`: when these datums are one part of a batch sent over several calls.
  absl::StatusOr<v1::ForwardBackwardResponse> ForwardBackward(const std::vector<v1::Datum>& datums,
                                                              const v1::LossConfig& loss,
                                                              const v1::BatchTotals* batch_totals = nullptr);
  absl::StatusOr<v1::ForwardBackwardResponse> Forward(const std::vector<v1::Datum>& datums);
  absl::StatusOr<v1::StepResponse> OptimStep(const v1::AdamWParams& adamw);
  absl::StatusOr<v1::StepResponse> TrainStep(const std::vector<v1::Datum>& datums,
                                             const v1::LossConfig& loss,
                                             const v1::AdamWParams& adamw,
                                             int64_t max_tokens_per_microbatch = 0);
  absl::StatusOr<v1::Run> LoadState(const std::string& path);

  int max_attempts = 5;  // transient failures are retried with the same request_id
  // Datums travel as packed_datums (one array per field) where that form can say the same;
  // false: always as repeated Datum messages.
  bool pack_datums = true;

 private:
  RunSession(TrainerClient* client, std::string run_id, int64_t next)
      : client_(client), run_id_(std::move(run_id)), next_sequence_id_(next) {}
  template <typename Resp, typename Call>
  absl::StatusOr<Resp> Mutate(Call call);
  template <typename Req>
  void SetDatums(const std::vector<v1::Datum>& datums, Req* req) const;

  TrainerClient* client_;
  std::string run_id_;
  int64_t next_sequence_id_;
  // Kept between steps, so packing reuses the arrays' buffers: a 0.5 MB batch packed afresh
  // cost the client ~130 minor page faults a step (glibc maps blocks of 128 KB and more).
  v1::TrainStepRequest train_step_request_;
  v1::PackedDatums train_step_packed_;
};

}  // namespace lorastep

#endif  // LORASTEP_CLIENTS_CPP_TRAINER_CLIENT_H_
