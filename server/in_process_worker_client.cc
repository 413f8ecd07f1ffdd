#include "server/in_process_worker_client.h"

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {
namespace {

// A call's response, or its error.
template <typename Response, typename Request, typename Method>
absl::StatusOr<Response> Answer(WorkerCalls* calls, Method method, const Request& req) {
  Response resp;
  LORASTEP_RETURN_IF_ERROR((calls->*method)(req, &resp));
  return resp;
}

// The same for a batch call: the shard's datums handed over as they are when the shard is
// the whole batch in order (always at world size 1), else copied out.
template <typename Response, typename Request, typename Method>
absl::StatusOr<Response> AnswerBatch(WorkerCalls* calls, Method method, const Request& req, const BatchShard& batch) {
  Response resp;
  // Past the client's deadline, or once the client went away, nobody waits: stop at the next
  // micro-batch, as a worker does.
  const WorkerCore::Cancelled cancelled = [deadline = batch.deadline, cancel = batch.cancel] {
    return std::chrono::system_clock::now() > deadline || (cancel != nullptr && cancel->cancelled());
  };
  if (batch.datums == nullptr) {
    LORASTEP_RETURN_IF_ERROR((calls->*method)(req, &resp, nullptr, cancelled));
    return resp;
  }
  const std::vector<Datum>& all = *batch.datums;
  const std::vector<int>& indices = *batch.indices;
  bool whole = indices.size() == all.size();
  for (size_t i = 0; whole && i < indices.size(); ++i) whole = indices[i] == static_cast<int>(i);
  std::vector<Datum> shard;
  if (!whole) {
    shard.reserve(indices.size());
    for (int i : indices) shard.push_back(all[i]);
  }
  LORASTEP_RETURN_IF_ERROR((calls->*method)(req, &resp, whole ? &all : &shard, cancelled));
  return resp;
}

}  // namespace

absl::StatusOr<std::unique_ptr<InProcessWorkerClient>> InProcessWorkerClient::Create(const WorkerOptions& options) {
  if (options.sizes.world() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "in_process_worker: serves world size 1 only, not ", options.sizes.world(), " (a mesh's ranks are processes)"));
  }
  LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<WorkerCore> core, WorkerCore::Create(options));
  return std::unique_ptr<InProcessWorkerClient>(new InProcessWorkerClient(std::move(core)));
}

absl::StatusOr<v1::WorkerInfo> InProcessWorkerClient::Info() {
  v1::WorkerInfo info;
  calls_.Info(&info);
  return info;
}

absl::StatusOr<v1::WorkerCreateRunResponse> InProcessWorkerClient::CreateRun(const v1::WorkerCreateRunRequest& req) {
  return Answer<v1::WorkerCreateRunResponse>(&calls_, &WorkerCalls::CreateRun, req);
}

absl::Status InProcessWorkerClient::DeleteRun(const v1::WorkerDeleteRunRequest& req) { return calls_.DeleteRun(req); }

absl::StatusOr<v1::WorkerForwardBackwardResponse> InProcessWorkerClient::ForwardBackward(
    const v1::WorkerForwardBackwardRequest& req, const BatchShard& batch) {
  return AnswerBatch<v1::WorkerForwardBackwardResponse>(&calls_, &WorkerCalls::ForwardBackward, req, batch);
}

absl::StatusOr<v1::WorkerForwardBackwardResponse> InProcessWorkerClient::Forward(const v1::WorkerForwardRequest& req,
                                                                                 const BatchShard& batch) {
  return AnswerBatch<v1::WorkerForwardBackwardResponse>(&calls_, &WorkerCalls::Forward, req, batch);
}

absl::StatusOr<v1::WorkerStepResponse> InProcessWorkerClient::OptimStep(const v1::WorkerOptimStepRequest& req) {
  return Answer<v1::WorkerStepResponse>(&calls_, &WorkerCalls::OptimStep, req);
}

absl::StatusOr<v1::WorkerStepResponse> InProcessWorkerClient::TrainStep(const v1::WorkerTrainStepRequest& req,
                                                                         const BatchShard& batch) {
  return AnswerBatch<v1::WorkerStepResponse>(&calls_, &WorkerCalls::TrainStep, req, batch);
}

absl::StatusOr<v1::SampleResponse> InProcessWorkerClient::Sample(const v1::WorkerSampleRequest& req, CancelToken* cancel) {
  v1::SampleResponse resp;
  LORASTEP_RETURN_IF_ERROR(calls_.Sample(req, &resp, [cancel] { return cancel != nullptr && cancel->cancelled(); }));
  return resp;
}

absl::StatusOr<v1::WorkerPathResponse> InProcessWorkerClient::SaveState(const v1::WorkerPathRequest& req) {
  return Answer<v1::WorkerPathResponse>(&calls_, &WorkerCalls::SaveState, req);
}

absl::StatusOr<v1::WorkerPathResponse> InProcessWorkerClient::LoadState(const v1::WorkerPathRequest& req) {
  return Answer<v1::WorkerPathResponse>(&calls_, &WorkerCalls::LoadState, req);
}

absl::StatusOr<v1::WorkerPathResponse> InProcessWorkerClient::StoreAdapter(const v1::WorkerStoreAdapterRequest& req) {
  return Answer<v1::WorkerPathResponse>(&calls_, &WorkerCalls::StoreAdapter, req);
}
absl::StatusOr<v1::WorkerPathResponse> InProcessWorkerClient::ExportAdapter(const v1::WorkerPathRequest& req) {
  return Answer<v1::WorkerPathResponse>(&calls_, &WorkerCalls::ExportAdapter, req);
}

absl::StatusOr<v1::ListCheckpointsResponse> InProcessWorkerClient::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  return Answer<v1::ListCheckpointsResponse>(&calls_, &WorkerCalls::ListCheckpoints, req);
}

absl::Status InProcessWorkerClient::AwaitSaved(const v1::WorkerPathRequest& req) { return calls_.AwaitSaved(req); }
absl::Status InProcessWorkerClient::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  return calls_.DeleteCheckpoint(req);
}

}  // namespace lorastep
