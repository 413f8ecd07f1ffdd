#include "server/grpc_worker_client.h"

#include <algorithm>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "rpc/grpc_status.h"
#include "rpc/proto_convert.h"

namespace lorastep {
namespace {

// The pipe's shared region for call payloads: several 64 x 512 batches (0.5 MB each) of the
// runs a worker serves at once; a larger payload, or one that finds no free span, goes inline.
// Its pages are allocated as payloads first reach them.
constexpr uint64_t kPipeRegionBytes = 64ull << 20;
// Room before a staged batch for the rest of its call's payload: the worker request's own
// fields and the batch field's head (a few hundred bytes; a call whose bytes do not fit copies
// the batch again).
constexpr uint64_t kStagedFrontBytes = 4096;

// The shard's datums as a request carries them (packed where that form can say them): the
// wire form its ranks share, or one made into `local`. Null when the request carries its own.
const ShardWireForms::Form* WireFormOf(const BatchShard& batch, ShardWireForms::Form* local) {
  if (batch.datums == nullptr) return nullptr;
  auto build = [&](ShardWireForms::Form* out) {
    SetRequestDatums(*batch.datums, *batch.indices, &out->datums, &out->packed);
    // Sizes cached once, before ranks share the form: the pipe's payload is written with them.
    for (const v1::Datum& datum : out->datums) datum.ByteSizeLong();
  };
  if (batch.wire == nullptr) {
    build(local);
    return local;
  }
  return &batch.wire->Get(batch.shard, build);
}

// The request as gRPC sends it: with the shard's datums.
template <typename Req>
absl::StatusOr<Req> WithDatums(const Req& req, const BatchShard& batch) {
  Req full = req;
  if constexpr (HasPackedDatums<Req>::value) {
    if (batch.as_sent != nullptr) {
      LORASTEP_RETURN_IF_ERROR(batch.as_sent->ParseInto(full.mutable_packed_datums()));
      return full;
    }
    ShardWireForms::Form local;
    if (const ShardWireForms::Form* form = WireFormOf(batch, &local)) {
      *full.mutable_datums() = form->datums;
      *full.mutable_packed_datums() = form->packed;
    }
  }
  return full;
}

// The same request as the call pipe sends it: its own bytes, then the shard's datums written
// after them (protobuf merges what follows into the message) instead of copied into a request
// first. Datums the packed form cannot say are serialized into `payload`; packed ones go from
// where they lie as `*pieces`: the client's in the bytes they came in, or the shard's wire
// form's arrays (`packed`). `local` holds a wire form made for this call alone; it and the
// batch must outlive the write.
template <typename Req>
std::string PipePayload(const Req& req, const BatchShard& batch, ShardWireForms::Form* local,
                        std::optional<PackedDatumsField>* packed, std::vector<absl::string_view>* pieces) {
  std::string payload = req.SerializeAsString();
  if constexpr (HasPackedDatums<Req>::value) {
    if (batch.as_sent != nullptr) {
      payload += LengthDelimitedHead(Req::kPackedDatumsFieldNumber, batch.as_sent->size());
      *pieces = batch.as_sent->pieces();
      return payload;
    }
    const ShardWireForms::Form* form = WireFormOf(batch, local);
    if (form != nullptr && !form->datums.empty()) {
      google::protobuf::io::StringOutputStream stream(&payload);
      google::protobuf::io::CodedOutputStream out(&stream);
      using google::protobuf::internal::WireFormatLite;
      for (const v1::Datum& datum : form->datums) WireFormatLite::WriteMessage(Req::kDatumsFieldNumber, datum, &out);
    }  // the streams trim `payload` to what was written when they go
    if (form != nullptr && form->packed.lengths_size() > 0) {
      packed->emplace(Req::kPackedDatumsFieldNumber, form->packed);
      payload += (*packed)->head();
      *pieces = (*packed)->pieces();
    }
  }
  return payload;
}

}  // namespace

GrpcWorkerClient::GrpcWorkerClient(const std::string& address, std::chrono::seconds call_timeout,
                                   std::string worker_token, const WorkerTls& tls, int call_pipe_fd, bool spawned)
    : address_(address), call_timeout_(call_timeout), spawned_(spawned),
      pipe_(call_pipe_fd >= 0 ? std::make_unique<CallPipeClient>(call_pipe_fd, address, 1ull << 30, kPipeRegionBytes) : nullptr),
      authorization_(worker_token.empty() ? "" : "Bearer " + worker_token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.ca_pem;
  ssl.pem_cert_chain = tls.client_cert_pem;
  ssl.pem_private_key = tls.client_key_pem;
  channel_ = grpc::CreateCustomChannel(
      address, tls.ca_pem.empty() ? grpc::InsecureChannelCredentials() : grpc::SslCredentials(ssl), args);
  stub_ = v1::Worker::NewStub(channel_);
}

absl::Status GrpcWorkerClient::WaitReady(int timeout_seconds) {
  if (!channel_->WaitForConnected(std::chrono::system_clock::now() +
                                  std::chrono::seconds(timeout_seconds))) {
    return absl::UnavailableError(absl::StrCat("worker ", address_, ": not reachable"));
  }
  return absl::OkStatus();
}

template <typename Resp, typename Req, typename Method>
absl::StatusOr<Resp> GrpcWorkerClient::Call(Method method, const Req& req, std::chrono::seconds timeout,
                                             std::chrono::system_clock::time_point deadline, CancelToken* cancel) {
  grpc::ClientContext ctx;
  CancelToken::Registration on_cancel(cancel, [&ctx] { ctx.TryCancel(); });
  ctx.set_deadline(std::min(deadline, std::chrono::system_clock::now() + (timeout.count() > 0 ? timeout : call_timeout_)));
  if (!authorization_.empty()) ctx.AddMetadata("authorization", authorization_);
  {
    std::lock_guard<std::mutex> lock(in_flight_mu_);
    in_flight_.insert(&ctx);
  }
  Resp resp;
  grpc::Status s = (stub_.get()->*method)(&ctx, req, &resp);
  {
    std::lock_guard<std::mutex> lock(in_flight_mu_);
    in_flight_.erase(&ctx);
  }
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

template <typename Resp, typename Req, typename Method>
absl::StatusOr<Resp> GrpcWorkerClient::StepCall(Method method, WorkerPipeMethod pipe_method, const Req& req,
                                                 const BatchShard& batch) {
  if (pipe_ == nullptr) {
    LORASTEP_ASSIGN_OR_RETURN(Req full, WithDatums(req, batch));
    return Call<Resp>(method, full, std::chrono::seconds(0), batch.deadline, batch.cancel);
  }
  ShardWireForms::Form local;
  std::optional<PackedDatumsField> packed;
  std::vector<absl::string_view> pieces;
  std::string payload = PipePayload(req, batch, &local, &packed, &pieces);
  const StagedTail* staged = batch.as_sent != nullptr ? batch.as_sent->staged() : nullptr;
  LORASTEP_ASSIGN_OR_RETURN(std::string answer,
                            pipe_->Call(static_cast<uint8_t>(pipe_method), std::move(payload),
                                        std::min(batch.deadline, std::chrono::system_clock::now() + call_timeout_),
                                        std::move(pieces), staged, batch.cancel));
  Resp resp;
  if (!resp.ParseFromString(answer)) {
    return absl::DataLossError(absl::StrCat("worker ", address_, ": an answer that does not parse as ",
                                            Resp::descriptor()->full_name()));
  }
  return resp;
}

void GrpcWorkerClient::StageBatch(PackedDatumsWire* batch) {
  if (pipe_ != nullptr) batch->set_staged(pipe_->Stage(kStagedFrontBytes, batch->pieces()));
}

void GrpcWorkerClient::CancelInFlight() {
  if (pipe_ != nullptr) pipe_->CancelAll();
  std::lock_guard<std::mutex> lock(in_flight_mu_);
  for (grpc::ClientContext* ctx : in_flight_) ctx->TryCancel();
}

absl::StatusOr<v1::WorkerInfo> GrpcWorkerClient::Info() {
  return Call<v1::WorkerInfo>(&v1::Worker::Stub::Info, v1::WorkerInfoRequest());
}
absl::Status GrpcWorkerClient::Ping(std::chrono::seconds timeout) {
  return Call<v1::WorkerInfo>(&v1::Worker::Stub::Info, v1::WorkerInfoRequest(), timeout).status();
}
absl::StatusOr<v1::WorkerCreateRunResponse> GrpcWorkerClient::CreateRun(const v1::WorkerCreateRunRequest& req) {
  return Call<v1::WorkerCreateRunResponse>(&v1::Worker::Stub::CreateRun, req);
}
absl::StatusOr<v1::ListCheckpointsResponse> GrpcWorkerClient::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  return Call<v1::ListCheckpointsResponse>(&v1::Worker::Stub::ListCheckpoints, req);
}
absl::Status GrpcWorkerClient::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  return Call<v1::DeleteCheckpointResponse>(&v1::Worker::Stub::DeleteCheckpoint, req)
      .status();
}
absl::Status GrpcWorkerClient::DeleteRun(const v1::WorkerDeleteRunRequest& req) {
  return Call<v1::WorkerDeleteRunResponse>(&v1::Worker::Stub::DeleteRun, req)
      .status();
}
absl::StatusOr<v1::WorkerForwardBackwardResponse> GrpcWorkerClient::ForwardBackward(
    const v1::WorkerForwardBackwardRequest& req, const BatchShard& batch) {
  return StepCall<v1::WorkerForwardBackwardResponse>(&v1::Worker::Stub::ForwardBackward,
                                                     WorkerPipeMethod::kForwardBackward, req, batch);
}
absl::StatusOr<v1::WorkerForwardBackwardResponse> GrpcWorkerClient::Forward(const v1::WorkerForwardRequest& req,
                                                                            const BatchShard& batch) {
  return StepCall<v1::WorkerForwardBackwardResponse>(&v1::Worker::Stub::Forward, WorkerPipeMethod::kForward, req,
                                                     batch);
}
absl::StatusOr<v1::WorkerStepResponse> GrpcWorkerClient::OptimStep(const v1::WorkerOptimStepRequest& req) {
  return StepCall<v1::WorkerStepResponse>(&v1::Worker::Stub::OptimStep, WorkerPipeMethod::kOptimStep, req,
                                          BatchShard{});
}
absl::StatusOr<v1::WorkerStepResponse> GrpcWorkerClient::TrainStep(const v1::WorkerTrainStepRequest& req,
                                                                    const BatchShard& batch) {
  return StepCall<v1::WorkerStepResponse>(&v1::Worker::Stub::TrainStep, WorkerPipeMethod::kTrainStep, req, batch);
}
absl::StatusOr<v1::SampleResponse> GrpcWorkerClient::Sample(const v1::WorkerSampleRequest& req, CancelToken* cancel) {
  // The worker-call timeout applies; the client's call, cancelled, ends it sooner.
  return Call<v1::SampleResponse>(&v1::Worker::Stub::Sample, req, std::chrono::seconds(0),
                                  std::chrono::system_clock::time_point::max(), cancel);
}

absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::SaveState(const v1::WorkerPathRequest& req) {
  return Call<v1::WorkerPathResponse>(&v1::Worker::Stub::SaveState, req);
}
absl::Status GrpcWorkerClient::AwaitSaved(const v1::WorkerPathRequest& req) {
  return Call<v1::WorkerPathResponse>(&v1::Worker::Stub::AwaitSaved, req).status();
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::LoadState(const v1::WorkerPathRequest& req) {
  return Call<v1::WorkerPathResponse>(&v1::Worker::Stub::LoadState, req);
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::StoreAdapter(const v1::WorkerStoreAdapterRequest& req) {
  return Call<v1::WorkerPathResponse>(&v1::Worker::Stub::StoreAdapter, req);
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::ExportAdapter(
    const v1::WorkerPathRequest& req) {
  return Call<v1::WorkerPathResponse>(&v1::Worker::Stub::ExportAdapter, req);
}

}  // namespace lorastep
