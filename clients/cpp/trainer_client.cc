#include "clients/cpp/trainer_client.h"

#include "rpc/proto_convert.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "rpc/grpc_status.h"

namespace lorastep {

// The largest response this client receives; Forward(Backward) requests state it, so a call
// whose log-probs would not fit is refused before any work instead of after.
constexpr int64_t kMaxResponseBytes = int64_t{1} << 30;

namespace {

bool Transient(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

std::string NewRequestId() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return buf;
}

TrainerClient::TrainerClient(std::shared_ptr<grpc::Channel> channel, std::string authorization)
    : channel_(std::move(channel)), authorization_(std::move(authorization)), stub_(v1::Trainer::NewStub(channel_)) {}

namespace {

// The step calls' indices into the client's answer windows, and their methods.
enum StepKind { kForwardBackward = 0, kForward = 1, kOptimStep = 2, kTrainStep = 3 };
constexpr const char* kTrainStepMethod = "/lorastep.v1.Trainer/TrainStep";

}  // namespace

template <typename Resp>
absl::StatusOr<Resp> TrainerClient::StepCall(int kind, const char* method, const grpc::ByteBuffer& request) {
  using Clock = AnswerWindows::Clock;
  grpc::ClientContext ctx;
  if (!authorization_.empty()) ctx.AddMetadata("authorization", authorization_);
  grpc::CompletionQueue cq;
  grpc::GenericStub generic(channel_);
  grpc::ByteBuffer answer;
  grpc::Status status;
  const Clock::time_point start = Clock::now();
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call = generic.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  call->Finish(&answer, &status, &status);
  void* tag = nullptr;
  bool ok = false;
  bool done = false;
  if (const AnswerWindows::Window w = windows_.For(kind, start); poll_for_answers_ && w.known) {
    if (Clock::now() < w.opens) {  // sleeps until the window opens (or the answer comes first)
      done = cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + (w.opens - Clock::now())) ==
             grpc::CompletionQueue::GOT_EVENT;
    }
    while (!done && Clock::now() < w.closes) {  // polls without blocking: the answer is read as it lands
      done = cq.AsyncNext(&tag, &ok, std::chrono::system_clock::time_point()) == grpc::CompletionQueue::GOT_EVENT;
    }
  }
  if (!done) cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {}
  if (!status.ok()) return FromGrpcStatus(status);
  windows_.Record(kind, Clock::now() - start);
  Resp resp;
  if (grpc::Status parsed = grpc::SerializationTraits<Resp>::Deserialize(&answer, &resp); !parsed.ok()) {
    return FromGrpcStatus(parsed);
  }
  return resp;
}

template <typename Resp, typename Req>
absl::StatusOr<Resp> TrainerClient::StepCall(int kind, const char* method, const Req& req) {
  grpc::ByteBuffer request;
  bool own_buffer = false;
  if (grpc::Status s = grpc::SerializationTraits<Req>::Serialize(req, &request, &own_buffer); !s.ok()) {
    return FromGrpcStatus(s);
  }
  return StepCall<Resp>(kind, method, request);
}

absl::StatusOr<v1::StepResponse> TrainerClient::TrainStep(const v1::TrainStepRequest& req,
                                                          const v1::PackedDatums& packed) {
  // The request's bytes: its own fields, then packed_datums' head and its arrays, each a slice
  // of bytes that `req` and `packed` hold (gRPC takes static slices as they are). They and
  // `head` outlive the call.
  std::string head = req.SerializeAsString();
  const PackedDatumsField field(v1::TrainStepRequest::kPackedDatumsFieldNumber, packed);
  head += field.head();
  std::vector<grpc::Slice> slices;
  slices.reserve(field.pieces().size() + 1);
  slices.emplace_back(head.data(), head.size(), grpc::Slice::STATIC_SLICE);
  for (absl::string_view piece : field.pieces()) slices.emplace_back(piece.data(), piece.size(), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer request(slices.data(), slices.size());
  return StepCall<v1::StepResponse>(kTrainStep, kTrainStepMethod, request);
}

absl::StatusOr<v1::StepResponse> TrainerClient::TrainStep(const v1::TrainStepRequest& req) {
  return StepCall<v1::StepResponse>(kTrainStep, kTrainStepMethod, req);
}
absl::StatusOr<v1::ForwardBackwardResponse> TrainerClient::ForwardBackward(const v1::ForwardBackwardRequest& req) {
  return StepCall<v1::ForwardBackwardResponse>(kForwardBackward, "/lorastep.v1.Trainer/ForwardBackward", req);
}
absl::StatusOr<v1::ForwardBackwardResponse> TrainerClient::Forward(const v1::ForwardRequest& req) {
  return StepCall<v1::ForwardBackwardResponse>(kForward, "/lorastep.v1.Trainer/Forward", req);
}
absl::StatusOr<v1::StepResponse> TrainerClient::OptimStep(const v1::OptimStepRequest& req) {
  return StepCall<v1::StepResponse>(kOptimStep, "/lorastep.v1.Trainer/OptimStep", req);
}

absl::StatusOr<std::unique_ptr<TrainerClient>> TrainerClient::Connect(const std::string& address,
                                                                      int timeout_seconds,
                                                                      const std::string& api_key,
                                                                      const std::string& ca_pem) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxResponseBytes);
  args.SetMaxSendMessageSize(1 << 30);
  // Each client its own connection: gRPC would otherwise share one between clients of the
  // same address and arguments, and clients made for separate runs would take turns on its
  // one HTTP/2 stream of frames and its reading thread.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!ca_pem.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ca_pem;
    creds = grpc::SslCredentials(tls);
  }
  auto channel = grpc::CreateCustomChannel(address, creds, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::seconds(timeout_seconds))) {
    return absl::UnavailableError(absl::StrCat("cannot reach ", address));
  }
  return std::unique_ptr<TrainerClient>(new TrainerClient(channel, api_key.empty() ? "" : "Bearer " + api_key));
}

#define LORASTEP_CLIENT_CALL(Method, Req, Resp)                              \
  absl::StatusOr<v1::Resp> TrainerClient::Method(const v1::Req& req) {       \
    return CallUnary<v1::Resp>(stub_.get(), &v1::Trainer::Stub::Method, req, std::chrono::seconds(0), authorization_); \
  }
LORASTEP_CLIENT_CALL(CreateRun, CreateRunRequest, Run)
LORASTEP_CLIENT_CALL(SaveState, SaveStateRequest, SaveStateResponse)
LORASTEP_CLIENT_CALL(LoadState, LoadStateRequest, Run)
LORASTEP_CLIENT_CALL(ExportAdapter, ExportAdapterRequest, ExportAdapterResponse)
LORASTEP_CLIENT_CALL(ListCheckpoints, ListCheckpointsRequest, ListCheckpointsResponse)
LORASTEP_CLIENT_CALL(DeleteCheckpoint, DeleteCheckpointRequest, DeleteCheckpointResponse)
LORASTEP_CLIENT_CALL(GetStepMetrics, GetStepMetricsRequest, GetStepMetricsResponse)
LORASTEP_CLIENT_CALL(Sample, SampleRequest, SampleResponse)
#undef LORASTEP_CLIENT_CALL

absl::Status TrainerClient::DeleteRun(const std::string& run_id) {
  v1::DeleteRunRequest req;
  req.set_run_id(run_id);
  return CallUnary<v1::DeleteRunResponse>(stub_.get(), &v1::Trainer::Stub::DeleteRun, req, std::chrono::seconds(0),
                                          authorization_)
      .status();
}

absl::StatusOr<v1::Run> TrainerClient::GetRun(const std::string& run_id) {
  v1::GetRunRequest req;
  req.set_run_id(run_id);
  return CallUnary<v1::Run>(stub_.get(), &v1::Trainer::Stub::GetRun, req, std::chrono::seconds(0), authorization_);
}

absl::StatusOr<v1::ListRunsResponse> TrainerClient::ListRuns() {
  return CallUnary<v1::ListRunsResponse>(stub_.get(), &v1::Trainer::Stub::ListRuns, v1::ListRunsRequest(),
                                         std::chrono::seconds(0), authorization_);
}

absl::Status TrainerClient::WatchMetrics(
    const v1::WatchMetricsRequest& req, const std::function<bool(const v1::StepRecord&)>& on_record) {
  grpc::ClientContext ctx;
  if (!authorization_.empty()) ctx.AddMetadata("authorization", authorization_);
  auto reader = stub_->WatchMetrics(&ctx, req);
  v1::StepRecord record;
  while (reader->Read(&record)) {
    if (!on_record(record)) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (s.error_code() == grpc::StatusCode::CANCELLED) return absl::OkStatus();
  return FromGrpcStatus(s);
}

absl::StatusOr<bool> TrainerClient::Healthy() {
  // grpc.health.v1.Health/Check with an empty service name, as a raw call: the health
  // messages are tiny (field 1: service string / status enum), so encode them by hand.
  grpc::ClientContext ctx;
  grpc::GenericStub generic(channel_);
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = s;
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = SERVING (1)} encodes as 0x08 0x01.
  return bytes.size() >= 2 && bytes[0] == 0x08 && bytes[1] == 0x01;
}

absl::StatusOr<RunSession> RunSession::Create(TrainerClient* client, const v1::LoraConfig& lora,
                                              uint64_t seed, const std::string& run_id) {
  v1::CreateRunRequest req;
  req.set_request_id(NewRequestId());
  *req.mutable_lora() = lora;
  req.set_seed(seed);
  req.set_run_id(run_id);
  absl::StatusOr<v1::Run> run;
  for (int attempt = 0; attempt < 5; ++attempt) {
    run = client->CreateRun(req);
    if (run.ok() || !Transient(run.status())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100 << attempt));
  }
  if (!run.ok()) return run.status();
  return RunSession(client, run->run_id(), run->next_sequence_id());
}

absl::StatusOr<RunSession> RunSession::Attach(TrainerClient* client, const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(v1::Run run, client->GetRun(run_id));
  return RunSession(client, run.run_id(), run.next_sequence_id());
}

template <typename Resp, typename CallFn>
absl::StatusOr<Resp> RunSession::Mutate(CallFn call) {
  const std::string request_id = NewRequestId();
  absl::StatusOr<Resp> result;
  for (int attempt = 0; attempt < max_attempts; ++attempt) {
    result = call(request_id, next_sequence_id_);
    if (result.ok() || !Transient(result.status())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100 << attempt));
  }
  if (result.ok()) ++next_sequence_id_;
  return result;
}

template <typename Req>
void RunSession::SetDatums(const std::vector<v1::Datum>& datums, Req* req) const {
  req->clear_datums();
  if (pack_datums && PackDatums(datums, req->mutable_packed_datums())) return;
  req->clear_packed_datums();
  req->mutable_datums()->Assign(datums.begin(), datums.end());
}

absl::StatusOr<v1::ForwardBackwardResponse> RunSession::ForwardBackward(
    const std::vector<v1::Datum>& datums, const v1::LossConfig& loss, const v1::BatchTotals* batch_totals) {
  v1::ForwardBackwardRequest req;
  req.set_run_id(run_id_);
  SetDatums(datums, &req);
  *req.mutable_loss() = loss;
  if (batch_totals != nullptr) *req.mutable_batch_totals() = *batch_totals;
  req.set_max_response_bytes(kMaxResponseBytes);  // the channel's receive limit
  return Mutate<v1::ForwardBackwardResponse>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return client_->ForwardBackward(req);
  });
}

absl::StatusOr<v1::ForwardBackwardResponse> RunSession::Forward(const std::vector<v1::Datum>& datums) {
  v1::ForwardRequest req;
  req.set_run_id(run_id_);
  SetDatums(datums, &req);
  req.set_max_response_bytes(kMaxResponseBytes);
  return client_->Forward(req);
}

absl::StatusOr<v1::StepResponse> RunSession::OptimStep(const v1::AdamWParams& adamw) {
  v1::OptimStepRequest req;
  req.set_run_id(run_id_);
  *req.mutable_adamw() = adamw;
  return Mutate<v1::StepResponse>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return client_->OptimStep(req);
  });
}

absl::StatusOr<v1::StepResponse> RunSession::TrainStep(const std::vector<v1::Datum>& datums,
                                                       const v1::LossConfig& loss,
                                                       const v1::AdamWParams& adamw,
                                                       int64_t max_tokens_per_microbatch) {
  v1::TrainStepRequest& req = train_step_request_;
  req.set_run_id(run_id_);
  req.clear_datums();
  // Packed beside the request, into the arrays' buffers of the last step.
  const bool packed = pack_datums && PackDatums(datums, &train_step_packed_);
  if (!packed) req.mutable_datums()->Assign(datums.begin(), datums.end());
  *req.mutable_loss() = loss;
  *req.mutable_adamw() = adamw;
  req.set_max_tokens_per_microbatch(max_tokens_per_microbatch);
  return Mutate<v1::StepResponse>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return packed ? client_->TrainStep(req, train_step_packed_) : client_->TrainStep(req);
  });
}

absl::StatusOr<v1::Run> RunSession::LoadState(const std::string& path) {
  v1::LoadStateRequest req;
  req.set_run_id(run_id_);
  req.set_path(path);
  return Mutate<v1::Run>([&](const std::string& rid, int64_t seq) {
    req.set_request_id(rid);
    req.set_sequence_id(seq);
    return client_->LoadState(req);
  });
}

}  // namespace lorastep
