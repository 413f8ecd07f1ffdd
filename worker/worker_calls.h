// The Worker API's calls without gRPC: proto requests in, proto responses out, over one
// WorkerCore. WorkerService (the gRPC adapter of a worker process) and
// InProcessWorkerClient (a worker inside the coordinator's process) both run every call
// through here, so the two answer alike.
//
// Thread-safety: any method from any thread. The core admits calls in arrival order; the
// exactly-once record is guarded here.
#ifndef LORASTEP_WORKER_WORKER_CALLS_H_
#define LORASTEP_WORKER_WORKER_CALLS_H_

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lib/prometheus_registry.h"
#include "lorastep/v1/worker.pb.h"
#include "worker/worker_core.h"

namespace lorastep {

class WorkerCalls {
 public:
  // `metrics`: this rank's step figures (rpc/step_metrics.h), labelled by run; may be null.
  // `record_calls`: keep the exactly-once record (Once). A caller in the same process passes
  // false: its calls cannot be lost in transit, so it never re-sends one, and copying each
  // response into the record is work on every step's path.
  explicit WorkerCalls(WorkerCore* core, PrometheusRegistry* metrics = nullptr, bool record_calls = true);

  void Info(v1::WorkerInfo* resp) const;
  absl::Status CreateRun(const v1::WorkerCreateRunRequest& req, v1::WorkerCreateRunResponse* resp);
  absl::Status DeleteRun(const v1::WorkerDeleteRunRequest& req);
  // The batch calls take their datums from the request, or, from an in-process caller that
  // has them parsed already, as `datums` (the request's datum fields are then ignored).
  // `cancelled`: asked between micro-batches (the gRPC call's IsCancelled); empty: never.
  absl::Status ForwardBackward(const v1::WorkerForwardBackwardRequest& req,
                               v1::WorkerForwardBackwardResponse* resp,
                               const std::vector<Datum>* datums = nullptr,
                               const WorkerCore::Cancelled& cancelled = {});
  absl::Status Forward(const v1::WorkerForwardRequest& req, v1::WorkerForwardBackwardResponse* resp,
                       const std::vector<Datum>* datums = nullptr, const WorkerCore::Cancelled& cancelled = {});
  absl::Status OptimStep(const v1::WorkerOptimStepRequest& req, v1::WorkerStepResponse* resp);
  // Completions from the run's adapter or the base model (WorkerCore::Sample); reads
  // nothing it changes, so it keeps no record. `cancelled`: asked between engine steps.
  absl::Status Sample(const v1::WorkerSampleRequest& req, v1::SampleResponse* resp,
                      const WorkerCore::Cancelled& cancelled = {});
  absl::Status TrainStep(const v1::WorkerTrainStepRequest& req, v1::WorkerStepResponse* resp,
                         const std::vector<Datum>* datums = nullptr, const WorkerCore::Cancelled& cancelled = {});
  absl::Status SaveState(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp);
  // Blocks until a background SaveState of req.path is written; touches no device.
  absl::Status AwaitSaved(const v1::WorkerPathRequest& req);
  absl::Status LoadState(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp);
  absl::Status ExportAdapter(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp);
  absl::Status StoreAdapter(const v1::WorkerStoreAdapterRequest& req, v1::WorkerPathResponse* resp);
  absl::Status ListCheckpoints(const v1::ListCheckpointsRequest& req, v1::ListCheckpointsResponse* resp);
  absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& req);

 private:
  // For mutating calls: a request_id already applied returns its recorded response and runs
  // nothing (exactly once on every rank, whatever the coordinator retries). A call whose
  // request_id is still running waits for it, then answers from its record.
  template <typename Work>
  absl::Status Once(const std::string& run_id, const v1::MeshCall& mesh, const char* method,
                    google::protobuf::Message* resp, Work work);
  // Drops the records of `run_id`'s calls: a run created again (restored from its autosave)
  // must apply a retried request_id, not answer it from the earlier run's record.
  void ForgetRecords(const std::string& run_id);

  bool OnMesh() const { return core_->options().sizes.world() > 1; }

  WorkerCore* core_;
  PrometheusRegistry* metrics_;
  const bool record_calls_;
  const std::string instance_id_;  // random per process (WorkerInfo.instance_id)
  // (run, request_id) -> (method, response serialized), the most recent kRecordedCalls. Kept
  // serialized: writing the bytes costs less than copying the message, and only a retry reads them.
  static constexpr size_t kRecordedCalls = 256;
  struct Recorded {
    std::string run_id;
    std::string method;
    std::string response;
  };
  std::mutex record_mu_;
  std::condition_variable record_cv_;  // a running request_id finished
  std::map<std::string, Recorded> recorded_;
  std::deque<std::string> recorded_order_;
  std::set<std::string> running_;
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_CALLS_H_
