#include "server/coordinator.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "lib/adamw_params.h"
#include "lib/lora_config.h"
#include "lib/status_macros.h"
#include "server/proto_convert.h"

namespace lorastep {

struct Coordinator::RunState {
  std::mutex mu;  // serializes calls on this run; guards everything below
  v1::Run run;
  WorkerClient* worker = nullptr;
  struct Recorded {
    std::string method;
    std::string response;  // serialized
  };
  std::map<std::string, Recorded> recorded;
  std::deque<std::string> recorded_order;  // oldest first, for eviction
  std::deque<v1::StepRecord> history;
  int64_t next_step = 0;
  std::mutex watch_mu;  // guards watchers; held while calling them
  std::map<int64_t, Watcher> watchers;
  int64_t next_watch_id = 1;
};

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

v1::WorkerPathRequest PathRequest(const std::string& run_id, const std::string& path) {
  v1::WorkerPathRequest req;
  req.set_run_id(run_id);
  req.set_path(path);
  return req;
}

absl::Status RequireRequestId(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: required for this call");
  return absl::OkStatus();
}

}  // namespace

absl::Status Coordinator::AddWorker(std::unique_ptr<WorkerClient> worker) {
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerInfo info, worker->Info());
  std::lock_guard<std::mutex> lock(mu_);
  if (workers_.empty()) {
    model_path_ = info.model_path();
    vocab_size_ = info.vocab_size();
  } else if (info.model_path() != model_path_ || info.vocab_size() != vocab_size_) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker->address(), " serves ",
                                                      info.model_path(), ", not ", model_path_));
  }
  workers_.push_back(std::move(worker));
  return absl::OkStatus();
}

size_t Coordinator::num_workers() {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_.size();
}

std::string Coordinator::model_path() {
  std::lock_guard<std::mutex> lock(mu_);
  return model_path_;
}

int64_t Coordinator::vocab_size() {
  std::lock_guard<std::mutex> lock(mu_);
  return vocab_size_;
}

absl::StatusOr<std::shared_ptr<Coordinator::RunState>> Coordinator::FindRun(
    const std::string& run_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  return it->second;
}

absl::StatusOr<v1::Run> Coordinator::CreateRun(const v1::CreateRunRequest& req) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(req.request_id()));
  LoraConfig lora = LoraConfigFromProto(req.lora());
  LORASTEP_RETURN_IF_ERROR(ValidateLoraConfig(lora));
  std::unique_lock<std::mutex> lock(mu_);
  if (workers_.empty()) {
    return absl::UnavailableError("coordinator: no workers registered yet; retry");
  }
  if (!req.base_model().empty() && req.base_model() != model_path_) {
    return absl::InvalidArgumentError(absl::StrCat("base_model: workers serve '", model_path_,
                                                   "', not '", req.base_model(), "'"));
  }
  auto prior = create_requests_.find(req.request_id());
  if (prior != create_requests_.end()) {  // retried CreateRun: the run it made
    auto run = runs_.at(prior->second);
    lock.unlock();
    std::lock_guard<std::mutex> run_lock(run->mu);
    return run->run;
  }
  if (creating_requests_.count(req.request_id())) {
    return absl::UnavailableError("request_id: this CreateRun is still in progress; retry");
  }
  std::string run_id = req.run_id();
  if (run_id.empty()) {
    do {
      run_id = absl::StrCat("run-", next_run_number_++);
    } while (runs_.count(run_id) || creating_ids_.count(run_id));
  } else if (runs_.count(run_id) || creating_ids_.count(run_id)) {
    return absl::AlreadyExistsError(absl::StrCat("run_id: '", run_id, "' exists"));
  }
  auto state = std::make_shared<RunState>();
  state->worker = workers_[(runs_.size() + creating_ids_.size()) % workers_.size()].get();
  state->run.set_run_id(run_id);
  state->run.set_base_model(model_path_);
  LoraConfigToProto(lora, state->run.mutable_lora());
  state->run.set_seed(req.seed());
  state->run.set_next_sequence_id(1);
  // The id is reserved while the worker builds the run; the run is visible only once built.
  creating_ids_.insert(run_id);
  creating_requests_.insert(req.request_id());
  lock.unlock();
  v1::WorkerCreateRunRequest wreq;
  wreq.set_run_id(run_id);
  *wreq.mutable_lora() = state->run.lora();
  wreq.set_seed(req.seed());
  absl::Status created = state->worker->CreateRun(wreq);
  lock.lock();
  creating_ids_.erase(run_id);
  creating_requests_.erase(req.request_id());
  if (!created.ok()) return created;
  runs_[run_id] = state;
  create_requests_[req.request_id()] = run_id;
  return state->run;
}

absl::StatusOr<v1::Run> Coordinator::GetRun(const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  std::lock_guard<std::mutex> lock(run->mu);
  return run->run;
}

std::vector<v1::Run> Coordinator::ListRuns() {
  std::vector<std::shared_ptr<RunState>> runs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : runs_) runs.push_back(r);
  }
  std::vector<v1::Run> out;
  for (auto& r : runs) {
    std::lock_guard<std::mutex> lock(r->mu);
    out.push_back(r->run);
  }
  return out;
}

absl::StatusOr<bool> Coordinator::Replay(RunState& run, const std::string& method,
                                         const std::string& request_id, int64_t sequence_id,
                                         google::protobuf::Message* out) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(request_id));
  auto it = run.recorded.find(request_id);
  if (it != run.recorded.end()) {
    if (it->second.method != method) {
      return absl::InvalidArgumentError(absl::StrCat("request_id: '", request_id,
                                                     "' was used for ", it->second.method));
    }
    out->ParseFromString(it->second.response);
    return true;
  }
  if (sequence_id != run.run.next_sequence_id()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence_id: expected ",
                                                      run.run.next_sequence_id(), ", got ",
                                                      sequence_id));
  }
  return false;
}

void Coordinator::Record(RunState& run, const std::string& method, const std::string& request_id,
                         const google::protobuf::Message& response) {
  run.recorded[request_id] = {method, response.SerializeAsString()};
  run.recorded_order.push_back(request_id);
  while (run.recorded_order.size() > options_.max_recorded_requests) {
    run.recorded.erase(run.recorded_order.front());
    run.recorded_order.pop_front();
  }
  run.run.set_next_sequence_id(run.run.next_sequence_id() + 1);
}

int64_t Coordinator::AppendStep(RunState& run, const std::string& kind,
                                const v1::StepResponse& step) {
  v1::StepRecord record;
  record.set_step(run.next_step++);
  record.set_kind(kind);
  record.set_learner_version(step.learner_version());
  record.set_unix_time_ms(NowMs());
  record.set_adapter_sha256(step.adapter_sha256());
  *record.mutable_metrics() = step.metrics();
  run.history.push_back(record);
  while (run.history.size() > options_.max_step_history) run.history.pop_front();
  std::lock_guard<std::mutex> lock(run.watch_mu);
  for (auto& [id, w] : run.watchers) w(record);
  return record.step();
}

absl::StatusOr<BatchTotals> Coordinator::ValidatedTotals(
    const google::protobuf::RepeatedPtrField<v1::Datum>& datums_proto,
    const v1::LossConfig& loss_proto) {
  LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(loss_proto));
  std::vector<Datum> datums = DatumsFromProto(datums_proto);
  LORASTEP_RETURN_IF_ERROR(ValidateBatch(datums, loss, vocab_size(), options_.limits));
  // The batch-wide denominators travel with it, so a shard normalizes like the whole batch
  // (data-parallel shards on several workers use the same totals).
  return ComputeBatchTotals(datums);
}

void Coordinator::CommitStep(RunState& run, const std::string& method, const std::string& kind,
                             const std::string& request_id, v1::StepResponse* resp) {
  run.run.set_learner_version(resp->learner_version());
  run.run.set_pending_forward_backward(0);
  resp->set_step(AppendStep(run, kind, *resp));
  Record(run, method, request_id, *resp);
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::ForwardBackward(
    const v1::ForwardBackwardRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::ForwardBackwardResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed, Replay(*run, "ForwardBackward", req.request_id(),
                                                  req.sequence_id(), &resp));
  if (replayed) return resp;
  LORASTEP_ASSIGN_OR_RETURN(const BatchTotals totals, ValidatedTotals(req.datums(), req.loss()));
  v1::WorkerForwardBackwardRequest wreq;
  wreq.set_run_id(req.run_id());
  *wreq.mutable_datums() = req.datums();
  *wreq.mutable_loss() = req.loss();
  wreq.set_batch_loss_tokens(totals.loss_tokens);
  wreq.set_batch_samples(totals.samples);
  LORASTEP_ASSIGN_OR_RETURN(resp, run->worker->ForwardBackward(wreq));
  run->run.set_pending_forward_backward(run->run.pending_forward_backward() + 1);
  Record(*run, "ForwardBackward", req.request_id(), resp);
  return resp;
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::Forward(const v1::ForwardRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  std::vector<Datum> datums = DatumsFromProto(req.datums());
  LORASTEP_RETURN_IF_ERROR(ValidateForwardBatch(datums, vocab_size(), options_.limits));
  v1::WorkerForwardRequest wreq;
  wreq.set_run_id(req.run_id());
  *wreq.mutable_datums() = req.datums();
  return run->worker->Forward(wreq);
}

absl::StatusOr<v1::StepResponse> Coordinator::OptimStep(const v1::OptimStepRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "OptimStep", req.request_id(), req.sequence_id(), &resp));
  if (replayed) return resp;
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  v1::WorkerOptimStepRequest wreq;
  wreq.set_run_id(req.run_id());
  *wreq.mutable_adamw() = req.adamw();
  LORASTEP_ASSIGN_OR_RETURN(resp, run->worker->OptimStep(wreq));
  CommitStep(*run, "OptimStep", "optim_step", req.request_id(), &resp);
  return resp;
}

absl::StatusOr<v1::StepResponse> Coordinator::TrainStep(const v1::TrainStepRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "TrainStep", req.request_id(), req.sequence_id(), &resp));
  if (replayed) return resp;
  if (req.max_tokens_per_microbatch() < 0) {
    return absl::InvalidArgumentError("max_tokens_per_microbatch: must be >= 0");
  }
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  LORASTEP_ASSIGN_OR_RETURN(const BatchTotals totals, ValidatedTotals(req.datums(), req.loss()));
  v1::WorkerTrainStepRequest wreq;
  wreq.set_run_id(req.run_id());
  *wreq.mutable_datums() = req.datums();
  *wreq.mutable_loss() = req.loss();
  *wreq.mutable_adamw() = req.adamw();
  wreq.set_batch_loss_tokens(totals.loss_tokens);
  wreq.set_batch_samples(totals.samples);
  wreq.set_max_tokens_per_microbatch(req.max_tokens_per_microbatch());
  LORASTEP_ASSIGN_OR_RETURN(resp, run->worker->TrainStep(wreq));
  CommitStep(*run, "TrainStep", "train_step", req.request_id(), &resp);
  return resp;
}

absl::StatusOr<v1::SaveStateResponse> Coordinator::SaveState(const v1::SaveStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  const v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse w, run->worker->SaveState(wreq));
  v1::SaveStateResponse resp;
  resp.set_path(req.path());
  resp.set_learner_version(w.learner_version());
  return resp;
}

absl::StatusOr<v1::Run> Coordinator::LoadState(const v1::LoadStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::Run resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "LoadState", req.request_id(), req.sequence_id(), &resp));
  if (replayed) return resp;
  const v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse w, run->worker->LoadState(wreq));
  run->run.set_learner_version(w.learner_version());
  run->run.set_pending_forward_backward(0);
  Record(*run, "LoadState", req.request_id(), run->run);  // bumps next_sequence_id
  resp = run->run;
  return resp;
}

absl::StatusOr<v1::ExportAdapterResponse> Coordinator::ExportAdapter(
    const v1::ExportAdapterRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  const v1::WorkerPathRequest wreq = PathRequest(req.run_id(), req.path());
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse w, run->worker->ExportAdapter(wreq));
  v1::ExportAdapterResponse resp;
  resp.set_path(req.path());
  resp.set_adapter_sha256(w.adapter_sha256());
  resp.set_learner_version(w.learner_version());
  return resp;
}

absl::StatusOr<v1::GetStepMetricsResponse> Coordinator::GetStepMetrics(
    const v1::GetStepMetricsRequest& req) {
  if (req.limit() < 0) return absl::InvalidArgumentError("limit: must be >= 0");
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::GetStepMetricsResponse resp;
  for (const auto& r : run->history) {
    if (r.step() < req.since_step()) continue;
    if (req.limit() > 0 && resp.steps_size() >= req.limit()) break;
    *resp.add_steps() = r;
  }
  return resp;
}

absl::StatusOr<int64_t> Coordinator::Watch(const std::string& run_id, int64_t since_step,
                                           Watcher watcher, std::vector<v1::StepRecord>* backlog) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, FindRun(run_id));
  // run->mu orders this against AppendStep: records before registration are in the
  // backlog, later ones reach the watcher.
  std::lock_guard<std::mutex> lock(run->mu);
  for (const auto& r : run->history) {
    if (r.step() >= since_step) backlog->push_back(r);
  }
  std::lock_guard<std::mutex> wlock(run->watch_mu);
  const int64_t id = run->next_watch_id++;
  run->watchers[id] = std::move(watcher);
  return id;
}

void Coordinator::Unwatch(const std::string& run_id, int64_t watch_id) {
  auto run = FindRun(run_id);
  if (!run.ok()) return;
  std::lock_guard<std::mutex> wlock((*run)->watch_mu);
  (*run)->watchers.erase(watch_id);
}

}  // namespace lorastep
