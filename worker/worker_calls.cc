#include "worker/worker_calls.h"

#include <unistd.h>

#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lib/status_macros.h"
#include "lib/training/adamw.h"
#include "rpc/proto_convert.h"
#include "rpc/step_metrics.h"

namespace lorastep {
namespace {

// The sampler's figures on this worker's metrics endpoint.
void DeclareSamplerMetrics(PrometheusRegistry* m) {
  using T = PrometheusRegistry::Type;
  m->Declare("lorastep_kv_blocks", T::kGauge, "the sampler's key/value cache blocks (0 before the first Sample)");
  m->Declare("lorastep_kv_blocks_used", T::kGauge, "key/value cache blocks held by sequences being sampled");
  m->Declare("lorastep_sampler_running_sequences", T::kGauge, "sequences being prefilled or decoded");
  m->Declare("lorastep_sampler_waiting_requests", T::kGauge, "sample requests waiting for cache blocks");
  m->Declare("lorastep_sampled_tokens_total", T::kCounter, "tokens sampled (rate(): decode tokens per second)");
  m->Declare("lorastep_prefill_tokens_total", T::kCounter,
             "prompt tokens prefilled, once per prompt (rate(): prefill tokens per second)");
  const std::vector<double> seconds = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30};
  m->Declare("lorastep_sample_time_to_first_token_seconds", T::kHistogram,
             "per prompt, from its arrival at the sampler to its samples' first tokens", seconds);
  m->Declare("lorastep_sample_time_per_output_token_seconds", T::kHistogram,
             "per prompt, time per token after the first (its longest sample)", seconds);
}

void PublishSamplerState(PrometheusRegistry* m, const WorkerCore::SamplerFigures& f) {
  if (m == nullptr) return;
  m->Set("lorastep_kv_blocks", {}, static_cast<double>(f.kv_blocks));
  m->Set("lorastep_kv_blocks_used", {}, static_cast<double>(f.kv_blocks_used));
  m->Set("lorastep_sampler_running_sequences", {}, static_cast<double>(f.running_sequences));
  m->Set("lorastep_sampler_waiting_requests", {}, static_cast<double>(f.waiting_requests));
}

// `partials`: the metrics as sums, counts and maxima too, which the coordinator merges over a
// mesh's ranks (a worker alone: its metrics are the answer's).
void FillForwardResponse(const ForwardBackwardResult& r, bool partials, v1::WorkerForwardBackwardResponse* resp) {
  for (const auto& lp : r.logprobs) {
    resp->mutable_result()->add_logprobs()->mutable_values()->Add(lp.begin(), lp.end());
  }
  MetricsToProto(r.metrics, resp->mutable_result()->mutable_metrics());
  if (partials) MetricPartialsToProto(r.metrics, resp->mutable_partials());
}

void FillStepResponse(const OptimStepResult& r, bool partials, v1::WorkerStepResponse* resp) {
  resp->mutable_result()->set_learner_version(r.learner_version);
  resp->mutable_result()->set_adapter_sha256(r.adapter_sha256);
  MetricsToProto(r.metrics, resp->mutable_result()->mutable_metrics());
  if (partials) MetricPartialsToProto(r.metrics, resp->mutable_partials());
  for (const auto& [family, sha] : r.replica_digests) (*resp->mutable_replica_digests())[family] = sha;
}

void FillPathResponse(const WorkerCore::PathResult& r, v1::WorkerPathResponse* resp) {
  resp->set_adapter_sha256(r.adapter_sha256);
  resp->set_learner_version(r.learner_version);
}

// `given`, or else the request's datums parsed into `parsed`.
template <typename Req>
absl::StatusOr<const std::vector<Datum>*> DatumsOf(const Req& req, const std::vector<Datum>* given,
                                                   std::vector<Datum>* parsed) {
  if (given != nullptr) return given;
  LORASTEP_ASSIGN_OR_RETURN(*parsed, RequestDatums(req.datums(), req.packed_datums()));
  return parsed;
}

// The whole batch's denominators when the call carries part of it; none: the call's datums
// are the whole batch, and the trainer counts them after validating them.
template <typename Req>
std::optional<BatchTotals> WholeBatchTotals(const Req& req) {
  if (!req.has_batch_loss_tokens() && !req.has_batch_samples()) return std::nullopt;
  return BatchTotals{req.batch_loss_tokens(), req.batch_samples()};
}

MeshCallInfo MeshFromProto(const v1::MeshCall& mesh) {
  return MeshCallInfo{mesh.request_id().empty() ? -1 : mesh.expected_learner_version(), mesh.mesh_generation(),
                      mesh.rendezvous(), mesh.client_deadline()};
}

std::string RandomInstanceId() {
  std::random_device device;
  std::mt19937_64 rng((static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(getpid()));
  return absl::StrFormat("%016x%016x", rng(), rng());
}

}  // namespace

WorkerCalls::WorkerCalls(WorkerCore* core, PrometheusRegistry* metrics, bool record_calls)
    : core_(core), metrics_(metrics), record_calls_(record_calls), instance_id_(RandomInstanceId()) {
  if (metrics_ != nullptr) {
    DeclareStepMetrics(metrics_);
    DeclareSamplerMetrics(metrics_);
  }
}

template <typename Work>
absl::Status WorkerCalls::Once(const std::string& run_id, const v1::MeshCall& mesh, const char* method,
                               google::protobuf::Message* resp, Work work) {
  if (mesh.request_id().empty() || !record_calls_) return work();
  // Per run: request ids are the clients' own, and two tenants may well pick the same one.
  const std::string id = absl::StrCat(run_id, "\n", mesh.request_id());
  {
    std::unique_lock<std::mutex> lock(record_mu_);
    record_cv_.wait(lock, [&] { return running_.count(id) == 0; });
    if (auto it = recorded_.find(id); it != recorded_.end()) {
      if (it->second.method != method) {
        return absl::InvalidArgumentError(
            absl::StrCat("request_id: '", mesh.request_id(), "' was used for ", it->second.method));
      }
      (void)resp->ParseFromString(it->second.response);  // this method's response, serialized by Once
      return absl::OkStatus();
    }
    running_.insert(id);
  }
  absl::Status s = work();
  {
    std::lock_guard<std::mutex> lock(record_mu_);
    running_.erase(id);
    if (s.ok()) {
      recorded_[id] = Recorded{run_id, method, resp->SerializeAsString()};
      recorded_order_.push_back(id);
      while (recorded_order_.size() > kRecordedCalls) {
        recorded_.erase(recorded_order_.front());
        recorded_order_.pop_front();
      }
    }
  }
  record_cv_.notify_all();
  return s;
}

void WorkerCalls::Info(v1::WorkerInfo* resp) const {
  resp->set_model_path(core_->options().model_path);
  resp->set_device(core_->base().device.str());
  resp->set_dtype(c10::toString(core_->base().dtype));
  resp->set_vocab_size(core_->base().config.vocab_size);
  resp->set_num_runs(static_cast<int64_t>(core_->num_runs()));
  const WorkerOptions& o = core_->options();
  resp->set_rank(o.rank);
  resp->set_world_size(o.sizes.world());
  resp->set_tp(o.sizes.tp);
  resp->set_pp(o.sizes.pp);
  resp->set_dp(o.sizes.dp);
  resp->set_ep(o.sizes.ep);
  resp->set_cp(o.sizes.cp);
  resp->set_instance_id(instance_id_);
  resp->set_state_store_id(core_->state_store_id());
  if (core_->groups() != nullptr) resp->set_rendezvous(o.rendezvous);  // rank 0's is where it serves the store
}

absl::Status WorkerCalls::CreateRun(const v1::WorkerCreateRunRequest& req, v1::WorkerCreateRunResponse* resp) {
  LORASTEP_ASSIGN_OR_RETURN(LoraConfig lora, LoraConfigFromProto(req.lora()));
  LORASTEP_ASSIGN_OR_RETURN(int64_t version, core_->CreateRun(req.run_id(), lora, req.seed(), req.init_from(),
                                                              req.init_with_optimizer(), MeshFromProto(req.mesh())));
  resp->set_learner_version(version);
  return absl::OkStatus();
}

void WorkerCalls::ForgetRecords(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(record_mu_);
  for (auto it = recorded_order_.begin(); it != recorded_order_.end();) {
    auto rec = recorded_.find(*it);
    if (rec != recorded_.end() && rec->second.run_id == run_id) {
      recorded_.erase(rec);
      it = recorded_order_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status WorkerCalls::DeleteRun(const v1::WorkerDeleteRunRequest& req) {
  ForgetRecords(req.run_id());
  absl::Status deleted = core_->DeleteRun(req.run_id());
  if (deleted.ok() && metrics_ != nullptr) metrics_->RemoveSeries("run", req.run_id());
  return deleted;
}

namespace {

// A call's activation_recompute: "" leaves the worker's --activation_recompute.
absl::StatusOr<std::optional<ActivationRecompute>> CallRecompute(const std::string& value) {
  if (value.empty()) return std::optional<ActivationRecompute>();
  LORASTEP_ASSIGN_OR_RETURN(ActivationRecompute mode, ParseActivationRecompute(value, "activation_recompute"));
  return std::optional<ActivationRecompute>(mode);
}

// Each position's k most likely tokens, as the answer carries them.
void AddTopLogprobs(const std::vector<std::vector<TopLogprob>>& positions,
                    google::protobuf::RepeatedPtrField<v1::TopLogprobs>* out) {
  for (const std::vector<TopLogprob>& top : positions) {
    v1::TopLogprobs* t = out->Add();
    for (const TopLogprob& e : top) {
      t->add_tokens(e.token);
      t->add_logprobs(e.logprob);
    }
  }
}

}  // namespace

absl::Status WorkerCalls::ForwardBackward(const v1::WorkerForwardBackwardRequest& req,
                                          v1::WorkerForwardBackwardResponse* resp, const std::vector<Datum>* given,
                                          const WorkerCore::Cancelled& cancelled) {
  return Once(req.run_id(), req.mesh(), "ForwardBackward", resp, [&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req.loss()));
    const std::optional<BatchTotals> totals = WholeBatchTotals(req);
    std::vector<Datum> parsed;
    LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum>* datums, DatumsOf(req, given, &parsed));
    LORASTEP_ASSIGN_OR_RETURN(std::optional<ActivationRecompute> recompute,
                              CallRecompute(req.activation_recompute()));
    LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult r,
                              core_->ForwardBackward(req.run_id(), *datums, loss, totals ? &*totals : nullptr,
                                                     recompute, MeshFromProto(req.mesh()), cancelled));
    FillForwardResponse(r, OnMesh(), resp);
    return absl::OkStatus();
  });
}

absl::Status WorkerCalls::Forward(const v1::WorkerForwardRequest& req, v1::WorkerForwardBackwardResponse* resp,
                                  const std::vector<Datum>* given, const WorkerCore::Cancelled& cancelled) {
  std::vector<Datum> parsed;
  LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum>* datums, DatumsOf(req, given, &parsed));
  LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult r, core_->Forward(req.run_id(), *datums, MeshFromProto(req.mesh()), cancelled));
  FillForwardResponse(r, OnMesh(), resp);
  return absl::OkStatus();
}

absl::Status WorkerCalls::Sample(const v1::WorkerSampleRequest& req, v1::SampleResponse* resp,
                                 const WorkerCore::Cancelled& cancelled) {
  // On a mesh a replica without a share of the prompts still takes part (its ranks vote).
  if (req.prompts_size() == 0 && !OnMesh()) return absl::InvalidArgumentError("prompts: empty");
  SamplingParams params;
  const v1::SamplingParams& p = req.params();
  params.max_tokens = p.max_tokens();
  params.temperature = p.temperature();
  params.top_k = p.top_k();
  params.top_p = p.has_top_p() ? p.top_p() : 1.0;
  params.min_p = p.min_p();
  params.seed = p.seed();
  params.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  for (const v1::TokenSequence& stop : p.stop_sequences()) params.stop_sequences.emplace_back(stop.tokens().begin(), stop.tokens().end());
  params.top_logprobs = p.top_logprobs();
  params.prompt_logprobs = p.prompt_logprobs();
  params.prompt_top_logprobs = p.prompt_top_logprobs();
  if (absl::Status s = CheckSamplingParams(params, core_->base().config.vocab_size, "params."); !s.ok()) return s;
  std::vector<SampleRequest> requests;
  for (const v1::TokenSequence& prompt : req.prompts()) {
    SampleRequest r;
    r.prompt.assign(prompt.tokens().begin(), prompt.tokens().end());
    r.num_samples = req.num_samples();
    r.params = params;
    requests.push_back(std::move(r));
  }
  absl::StatusOr<WorkerCore::SampleOutcome> done =
      core_->Sample(req.run_id(), req.base_model(), std::move(requests), cancelled, req.checkpoint(),
                    MeshFromProto(req.mesh()).Unchecked());
  PublishSamplerState(metrics_, core_->SamplerState());  // also after a refusal or a cancel
  LORASTEP_RETURN_IF_ERROR(done.status());
  WorkerCore::SampleOutcome& outcome = *done;
  int64_t sampled = 0, prefilled = 0;
  for (const SampleResult& r : outcome.results) {
    v1::PromptSamples* out = resp->add_prompts();
    out->mutable_prompt_logprobs()->Add(r.prompt_logprobs.begin(), r.prompt_logprobs.end());
    AddTopLogprobs(r.prompt_top_logprobs, out->mutable_prompt_top_logprobs());
    prefilled += r.prefill_tokens;
    for (const SampledSequence& seq : r.sequences) {
      v1::SampledSequence* s = out->add_sequences();
      s->mutable_tokens()->Add(seq.tokens.begin(), seq.tokens.end());
      s->mutable_logprobs()->Add(seq.logprobs.begin(), seq.logprobs.end());
      s->mutable_sampling_logprobs()->Add(seq.sampling_logprobs.begin(), seq.sampling_logprobs.end());
      s->set_stop_reason(seq.stop_reason);
      AddTopLogprobs(seq.top_logprobs, s->mutable_top_logprobs());
      sampled += static_cast<int64_t>(seq.tokens.size());
    }
  }
  resp->set_learner_version(outcome.learner_version);
  if (metrics_ != nullptr) {
    metrics_->Add("lorastep_sampled_tokens_total", {}, static_cast<double>(sampled));
    metrics_->Add("lorastep_prefill_tokens_total", {}, static_cast<double>(prefilled));
    for (const SampleResult& r : outcome.results) {
      metrics_->Observe("lorastep_sample_time_to_first_token_seconds", {}, r.time_to_first_token_s);
      if (r.time_per_output_token_s > 0) {
        metrics_->Observe("lorastep_sample_time_per_output_token_seconds", {}, r.time_per_output_token_s);
      }
    }
  }
  (*resp->mutable_metrics())["sampled_tokens:sum"] = static_cast<double>(sampled);
  (*resp->mutable_metrics())["prefill_tokens:sum"] = static_cast<double>(prefilled);
  (*resp->mutable_metrics())["sampler_steps:sum"] = static_cast<double>(outcome.engine_steps);
  return absl::OkStatus();
}

absl::Status WorkerCalls::OptimStep(const v1::WorkerOptimStepRequest& req, v1::WorkerStepResponse* resp) {
  return Once(req.run_id(), req.mesh(), "OptimStep", resp, [&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req.adamw()));
    LORASTEP_ASSIGN_OR_RETURN(OptimStepResult r, core_->OptimStep(req.run_id(), adamw, MeshFromProto(req.mesh())));
    FillStepResponse(r, OnMesh(), resp);
    RecordStepMetrics(metrics_, req.run_id(), "optim_step", resp->result().metrics(), r.learner_version);
    return absl::OkStatus();
  });
}

absl::Status WorkerCalls::TrainStep(const v1::WorkerTrainStepRequest& req, v1::WorkerStepResponse* resp,
                                    const std::vector<Datum>* given, const WorkerCore::Cancelled& cancelled) {
  return Once(req.run_id(), req.mesh(), "TrainStep", resp, [&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(req.loss()));
    LORASTEP_ASSIGN_OR_RETURN(AdamWParams adamw, AdamWParamsFromProto(req.adamw()));
    const std::optional<BatchTotals> totals = WholeBatchTotals(req);
    std::vector<Datum> parsed;
    LORASTEP_ASSIGN_OR_RETURN(const std::vector<Datum>* datums, DatumsOf(req, given, &parsed));
    LORASTEP_ASSIGN_OR_RETURN(std::optional<ActivationRecompute> recompute,
                              CallRecompute(req.activation_recompute()));
    LORASTEP_ASSIGN_OR_RETURN(OptimStepResult r,
                              core_->TrainStep(req.run_id(), *datums, loss, adamw, totals ? &*totals : nullptr,
                                               req.max_tokens_per_microbatch(), recompute, MeshFromProto(req.mesh()),
                                               cancelled));
    FillStepResponse(r, OnMesh(), resp);
    RecordStepMetrics(metrics_, req.run_id(), "train_step", resp->result().metrics(), r.learner_version);
    return absl::OkStatus();
  });
}

absl::Status WorkerCalls::SaveState(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp) {
  LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,
                            core_->SaveState(req.run_id(), req.path(), MeshFromProto(req.mesh()), req.background()));
  FillPathResponse(r, resp);
  return absl::OkStatus();
}

absl::Status WorkerCalls::StoreAdapter(const v1::WorkerStoreAdapterRequest& req, v1::WorkerPathResponse* resp) {
  LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,
                            core_->StoreAdapter(req.run_id(), req.path(), req.adapter_config(), req.adapter_model(),
                                                        req.replace()));
  FillPathResponse(r, resp);
  return absl::OkStatus();
}

absl::Status WorkerCalls::AwaitSaved(const v1::WorkerPathRequest& req) {
  return core_->AwaitSaved(req.run_id(), req.path());
}

absl::Status WorkerCalls::LoadState(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp) {
  return Once(req.run_id(), req.mesh(), "LoadState", resp, [&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(WorkerCore::PathResult r,
                              core_->LoadState(req.run_id(), req.path(), MeshFromProto(req.mesh()),
                                                              req.weights_only()));
    FillPathResponse(r, resp);
    return absl::OkStatus();
  });
}

absl::Status WorkerCalls::ExportAdapter(const v1::WorkerPathRequest& req, v1::WorkerPathResponse* resp) {
  LORASTEP_ASSIGN_OR_RETURN(
      WorkerCore::PathResult r,
      core_->ExportAdapter(req.run_id(), req.path(), MeshFromProto(req.mesh()), req.expand_experts()));
  FillPathResponse(r, resp);
  return absl::OkStatus();
}

absl::Status WorkerCalls::ListCheckpoints(const v1::ListCheckpointsRequest& req,
                                          v1::ListCheckpointsResponse* resp) {
  LORASTEP_ASSIGN_OR_RETURN(std::vector<StoredFolder> folders, core_->ListCheckpoints(req.run_id()));
  for (const StoredFolder& f : folders) {
    v1::Checkpoint* c = resp->add_checkpoints();
    c->set_name(f.name);
    c->set_ref(f.ref);
    c->set_bytes(f.bytes);
    c->set_modified_unix_s(f.modified_unix_s);
  }
  return absl::OkStatus();
}

absl::Status WorkerCalls::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  return core_->DeleteCheckpoint(req.run_id(), req.name());
}

}  // namespace lorastep
