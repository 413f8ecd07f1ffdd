#include "server/grpc_worker_client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_status.h"

namespace lorastep {
GrpcWorkerClient::GrpcWorkerClient(const std::string& address, std::chrono::seconds call_timeout)
    : address_(address), call_timeout_(call_timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::Worker::NewStub(channel_);
}

absl::Status GrpcWorkerClient::WaitReady(int timeout_seconds) {
  if (!channel_->WaitForConnected(std::chrono::system_clock::now() +
                                  std::chrono::seconds(timeout_seconds))) {
    return absl::UnavailableError(absl::StrCat("worker ", address_, ": not reachable"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::WorkerInfo> GrpcWorkerClient::Info() {
  return CallUnary<v1::WorkerInfo>(stub_.get(), &v1::Worker::Stub::Info,
                                                     v1::WorkerInfoRequest(), call_timeout_);
}
absl::StatusOr<v1::WorkerCreateRunResponse> GrpcWorkerClient::CreateRun(const v1::WorkerCreateRunRequest& req) {
  return CallUnary<v1::WorkerCreateRunResponse>(stub_.get(), &v1::Worker::Stub::CreateRun, req, call_timeout_);
}
absl::StatusOr<v1::ListCheckpointsResponse> GrpcWorkerClient::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  return CallUnary<v1::ListCheckpointsResponse>(stub_.get(), &v1::Worker::Stub::ListCheckpoints, req,
                                                call_timeout_);
}
absl::Status GrpcWorkerClient::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  return CallUnary<v1::DeleteCheckpointResponse>(stub_.get(), &v1::Worker::Stub::DeleteCheckpoint, req,
                                                 call_timeout_)
      .status();
}
absl::Status GrpcWorkerClient::DeleteRun(const v1::WorkerDeleteRunRequest& req) {
  return CallUnary<v1::WorkerDeleteRunResponse>(
             stub_.get(), &v1::Worker::Stub::DeleteRun, req, call_timeout_)
      .status();
}
absl::StatusOr<v1::WorkerForwardBackwardResponse> GrpcWorkerClient::ForwardBackward(
    const v1::WorkerForwardBackwardRequest& req) {
  return CallUnary<v1::WorkerForwardBackwardResponse>(
      stub_.get(), &v1::Worker::Stub::ForwardBackward, req, call_timeout_);
}
absl::StatusOr<v1::WorkerForwardBackwardResponse> GrpcWorkerClient::Forward(
    const v1::WorkerForwardRequest& req) {
  return CallUnary<v1::WorkerForwardBackwardResponse>(
      stub_.get(), &v1::Worker::Stub::Forward, req, call_timeout_);
}
absl::StatusOr<v1::WorkerStepResponse> GrpcWorkerClient::OptimStep(const v1::WorkerOptimStepRequest& req) {
  return CallUnary<v1::WorkerStepResponse>(stub_.get(),
                                                            &v1::Worker::Stub::OptimStep, req, call_timeout_);
}
absl::StatusOr<v1::WorkerStepResponse> GrpcWorkerClient::TrainStep(const v1::WorkerTrainStepRequest& req) {
  return CallUnary<v1::WorkerStepResponse>(stub_.get(),
                                                            &v1::Worker::Stub::TrainStep, req, call_timeout_);
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::SaveState(const v1::WorkerPathRequest& req) {
  return CallUnary<v1::WorkerPathResponse>(stub_.get(),
                                                             &v1::Worker::Stub::SaveState, req, call_timeout_);
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::LoadState(const v1::WorkerPathRequest& req) {
  return CallUnary<v1::WorkerPathResponse>(stub_.get(),
                                                             &v1::Worker::Stub::LoadState, req, call_timeout_);
}
absl::StatusOr<v1::WorkerPathResponse> GrpcWorkerClient::ExportAdapter(
    const v1::WorkerPathRequest& req) {
  return CallUnary<v1::WorkerPathResponse>(
      stub_.get(), &v1::Worker::Stub::ExportAdapter, req, call_timeout_);
}

}  // namespace lorastep
