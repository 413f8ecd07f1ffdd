#include "server/coordinator.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/hop_trace.h"
#include "lib/log.h"
#include "lib/model/lora_config.h"
#include "lib/status_macros.h"
#include "lib/training/adamw_params.h"
#include "rpc/proto_convert.h"
#include "rpc/step_metrics.h"
#include "server/request_checks.h"
#include "server/worker_requests.h"

namespace lorastep {
namespace {

WorkerPoolOptions PoolOptions(const CoordinatorOptions& o) {
  WorkerPoolOptions p;
  p.mesh = o.mesh;
  p.rendezvous_port = o.rendezvous_port;
  p.mesh_by_registration = o.mesh_by_registration;
  p.journaled = o.journal != nullptr;
  p.health_interval = o.worker_health_interval;
  p.restart_worker = o.restart_worker;
  p.restart_mesh = o.restart_mesh;
  return p;
}

PersistenceOptions PersistenceOptionsOf(const CoordinatorOptions& o) {
  PersistenceOptions p;
  p.journal = o.journal;
  p.autosave_in_background = o.autosave_in_background;
  p.autosave_every_steps = o.autosave_every_steps;
  p.autosave_max_share = o.autosave_max_share;
  p.autosave_every_full_steps = o.autosave_every_full_steps;
  p.autosave_when_idle = o.autosave_when_idle;
  p.max_step_history = o.max_step_history;
  p.record_limits = {o.max_recorded_requests, o.max_recorded_bytes};
  p.metrics = o.metrics;
  return p;
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)),
      runs_({options_.max_runs, options_.max_runs_per_owner}, options_.metrics),
      pool_(PoolOptions(options_)),
      mesh_(&pool_, options_.peer_failure_grace, options_.mesh_by_registration),
      split_(pool_.layout()),
      persistence_(PersistenceOptionsOf(options_), &runs_, &pool_, &mesh_) {
  if (options_.metrics != nullptr) DeclareStepMetrics(options_.metrics);
  WorkerRecovery recovery;
  recovery.worker_restarted = [this](const PooledWorker* dead, const WorkerRef& onto) {
    persistence_.WorkerRestarted(dead, onto);
  };
  recovery.mesh_back = [this](bool rejoined) { persistence_.MeshBack(rejoined); };
  recovery.reattached = [this](const WorkerRef& joined) { persistence_.Reattach(joined); };
  pool_.Start(std::move(recovery));
  persistence_.Start();
}

Coordinator::~Coordinator() {
  pool_.Stop();  // its restart thread restores runs through persistence_
  persistence_.Stop();
}

absl::Status Coordinator::AddWorker(std::unique_ptr<WorkerClient> worker) { return pool_.Add(std::move(worker)); }
void Coordinator::OnServingChange(std::function<void(bool)> callback) { pool_.OnServingChange(std::move(callback)); }
size_t Coordinator::num_workers() { return pool_.num_registered(); }
absl::StatusOr<MeshAssignment> Coordinator::AssignRank(const std::string& host) { return pool_.AssignRank(host); }
std::string Coordinator::model_path() { return pool_.model_path(); }
absl::StatusOr<int> Coordinator::RestoreRuns() { return persistence_.RestoreRuns(); }
bool Coordinator::WaitForAutosaves(std::chrono::milliseconds timeout) { return persistence_.WaitForAutosaves(timeout); }
void Coordinator::CancelWorkerCalls() { pool_.CancelInFlight(); }
void Coordinator::StopWorkerUpkeep() { pool_.Stop(); }

absl::Status Coordinator::CheckAccess(const std::string& run_id, const Caller& caller) {
  return runs_.CheckAccess(run_id, caller);
}

absl::StatusOr<v1::Run> Coordinator::CreateRun(const v1::CreateRunRequest& req, const std::string& owner,
                                                const std::string& id_prefix) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(req.request_id()));
  LORASTEP_ASSIGN_OR_RETURN(LoraConfig lora, LoraConfigFromProto(req.lora()));
  LORASTEP_RETURN_IF_ERROR(ValidateLoraConfig(lora));
  LORASTEP_RETURN_IF_ERROR(pool_.CheckCanCreate());
  const std::string model_path = pool_.model_path();
  if (!req.base_model().empty() && req.base_model() != model_path) {
    return absl::InvalidArgumentError(
        absl::StrCat("base_model: workers serve '", model_path, "', not '", req.base_model(), "'"));
  }
  const std::string fingerprint = absl::StrCat(owner, "\n", RequestFingerprint(req));
  LORASTEP_ASSIGN_OR_RETURN(RunRegistry::Reservation reserved,
                            runs_.Reserve(req.request_id(), fingerprint, owner, req.run_id(), id_prefix));
  if (reserved.existing != nullptr) {  // retried CreateRun: the run it made
    std::lock_guard<std::mutex> view(reserved.existing->view_mu);
    return reserved.existing->run;
  }
  // The id is reserved while the workers build the run; the run is visible only once built.
  auto release = [&](absl::Status s) {
    runs_.Release(reserved, req.request_id(), owner);
    return s;
  };
  auto state = std::make_shared<RunState>(RecordLimits{options_.max_recorded_requests, options_.max_recorded_bytes});
  auto placed = pool_.Place(reserved.placement);
  if (!placed.ok()) return release(placed.status());
  state->ranks = *std::move(placed);
  const std::string& run_id = reserved.run_id;
  state->run.set_run_id(run_id);
  state->run.set_base_model(model_path);
  LoraConfigToProto(lora, state->run.mutable_lora());
  state->run.set_seed(req.seed());
  state->run.set_next_sequence_id(1);
  state->run.set_created_unix_ms(NowUnixMs());
  state->run.set_owner(owner);
  state->run.set_last_step(-1);
  if (absl::Status s = persistence_.JournalCreate(state->run, req, fingerprint); !s.ok()) return release(s);
  v1::WorkerCreateRunRequest wreq;
  wreq.set_run_id(run_id);
  *wreq.mutable_lora() = state->run.lora();
  wreq.set_seed(req.seed());
  wreq.set_init_from(req.init_from());
  wreq.set_init_with_optimizer(req.init_with_optimizer());
  // Same seed on every rank: replicas start bitwise equal.
  auto created = FanOut<v1::WorkerCreateRunResponse>(*state, state->AllRanks(), [&](int, WorkerClient* w) {
    v1::WorkerCreateRunRequest call = wreq;
    mesh_.StampMesh(call.mutable_mesh());  // init_from loads collectively
    return w->CreateRun(call);
  });
  if (!created.ok()) {
    persistence_.JournalCreateFailed(run_id);
    return release(created.status());
  }
  state->run.set_learner_version((*created)[0].learner_version());  // a checkpoint's, with its optimizer
  // The journal names the run's weights, never a reference that can be replaced or deleted:
  // a run made from one is saved at once, and a restore loads that copy.
  if (!req.init_from().empty()) {
    if (absl::Status saved = persistence_.SaveDurably(*state); !saved.ok()) {
      v1::WorkerDeleteRunRequest del;
      del.set_run_id(run_id);
      FanOut<bool>(*state, state->AllRanks(), [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
        LORASTEP_RETURN_IF_ERROR(w->DeleteRun(del));
        return true;
      }).IgnoreError();
      persistence_.JournalCreateFailed(run_id);
      return release(absl::UnavailableError(absl::StrCat(
          "init_from: the run's copy of ", req.init_from(), " could not be saved (", saved.message(),
          "); nothing was created, retry")));
    }
  }
  v1::Run out = state->run;
  runs_.Commit(reserved, req.request_id(), owner, fingerprint, state);
  if (options_.metrics != nullptr) {
    options_.metrics->Set("lorastep_learner_version", {{"run", run_id}}, static_cast<double>(out.learner_version()));
  }
  return out;
}

absl::Status Coordinator::DeleteRun(const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(RunRef run, runs_.Find(run_id));
  std::unique_lock<std::mutex> run_lock(run->mu);  // after any call in flight on it
  if (runs_.Find(run_id).value_or(nullptr) != run) {  // a concurrent DeleteRun (or a restore) won
    return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  }
  // A run on a dead worker has no state left to free there: it is only forgotten.
  if (!run->OnDownWorker()) {
    v1::WorkerDeleteRunRequest wreq;
    wreq.set_run_id(run_id);
    LORASTEP_RETURN_IF_ERROR(FanOut<bool>(*run, run->AllRanks(), [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
                               LORASTEP_RETURN_IF_ERROR(w->DeleteRun(wreq));
                               return true;
                             }).status());
  }
  LORASTEP_RETURN_IF_ERROR(persistence_.Forget(*run));
  runs_.Remove(*run, /*forget_request=*/true);
  if (options_.metrics != nullptr) options_.metrics->RemoveSeries("run", run_id);
  // A deleted run's history and records go back to the OS, not just to malloc: trimmed once
  // they are freed (this was the last reference; trimming before it returns nothing, and a
  // long-lived coordinator's footprint grows with every run it ever served).
  run_lock.unlock();
  run.reset();
  malloc_trim(0);
  return absl::OkStatus();
}

absl::StatusOr<v1::Run> Coordinator::GetRun(const std::string& run_id) {
  LORASTEP_ASSIGN_OR_RETURN(RunRef run, runs_.Find(run_id));
  std::lock_guard<std::mutex> lock(run->view_mu);
  return run->run;
}

std::vector<v1::Run> Coordinator::ListRuns() {
  std::vector<v1::Run> out;
  for (const RunRef& r : runs_.All()) {
    std::lock_guard<std::mutex> lock(r->view_mu);
    out.push_back(r->run);
  }
  return out;
}

Coordinator::SequenceClaim& Coordinator::SequenceClaim::operator=(SequenceClaim&& other) noexcept {
  if (this != &other) {
    Release();
    run_ = std::move(other.run_);
    sequence_id_ = other.sequence_id_;
    request_id_ = std::move(other.request_id_);
    other.run_ = nullptr;
  }
  return *this;
}

Coordinator::SequenceClaim::~SequenceClaim() { Release(); }

void Coordinator::SequenceClaim::Release() {
  if (run_ == nullptr) return;
  std::lock_guard<std::mutex> view(run_->view_mu);
  auto it = run_->claimed_sequences.find(sequence_id_);
  if (it != run_->claimed_sequences.end() && it->second == request_id_) run_->claimed_sequences.erase(it);
  run_ = nullptr;
}

absl::StatusOr<Coordinator::SequenceClaim> Coordinator::ClaimSequence(const std::string& run_id, int64_t sequence_id,
                                                                      const std::string& request_id) {
  SequenceClaim claim;
  if (request_id.empty()) return claim;  // refused by the call itself (RequireRequestId)
  LORASTEP_ASSIGN_OR_RETURN(RunRef run, runs_.Find(run_id));
  std::lock_guard<std::mutex> view(run->view_mu);
  auto [it, added] = run->claimed_sequences.emplace(sequence_id, request_id);
  if (!added) {
    if (it->second == request_id) return claim;  // a retry of the call queued: it waits for that one
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence_id: ", sequence_id, " is taken by a call queued before this one (request_id '", it->second,
        "'); one call per sequence id at a time, nothing was applied"));
  }
  // A call that cannot be next when its turn comes is refused now rather than after a wait in
  // the queue: an id already passed under a new request_id (a retry of an applied one is
  // answered from its record in turn), or one past the next with nothing queued before it.
  // A claimed id stays claimed until its call has been recorded, so neither test races one.
  const int64_t next = run->run.next_sequence_id();
  const bool stale = sequence_id < next && !run->records.Contains(request_id);
  const bool early = sequence_id > next && !run->claimed_sequences.count(sequence_id - 1);
  if (stale || early) {
    run->claimed_sequences.erase(it);
    return absl::FailedPreconditionError(
        absl::StrCat("sequence_id: expected ", next, ", got ", sequence_id, run->restored_note));
  }
  claim.run_ = run;
  claim.sequence_id_ = sequence_id;
  claim.request_id_ = request_id;
  return claim;
}

absl::StatusOr<bool> Coordinator::Replay(RunState& run, const std::string& method, const std::string& request_id,
                                         int64_t sequence_id, const google::protobuf::Message& request,
                                         google::protobuf::Message* out, bool defer_fingerprint,
                                         const PackedField& packed) {
  LORASTEP_RETURN_IF_ERROR(RequireRequestId(request_id));
  const bool known = run.records.Contains(request_id);
  // A new request's fingerprint is only stored (by Record): a caller may defer it.
  run.current_fingerprint = known || !defer_fingerprint ? RequestFingerprint(request, packed) : "";
  if (known) {
    LORASTEP_ASSIGN_OR_RETURN(const std::string* response, run.records.Find(method, request_id, run.current_fingerprint));
    out->ParseFromString(*response);
    return true;
  }
  if (sequence_id != run.run.next_sequence_id()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence_id: expected ", run.run.next_sequence_id(), ", got ",
                                                      sequence_id, run.restored_note));
  }
  return false;
}

void Coordinator::Record(RunState& run, const std::string& method, const std::string& request_id,
                         const google::protobuf::Message& response, bool with_step) {
  std::string serialized = response.SerializeAsString();
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_next_sequence_id(run.run.next_sequence_id() + 1);
  }
  // Journaled before the response leaves.
  persistence_.JournalCall(run, method, request_id, serialized, with_step);
  run.records.Keep(request_id, method, std::move(serialized), run.current_fingerprint);
}

int64_t Coordinator::AppendStep(RunState& run, const std::string& kind, const v1::StepResponse& step) {
  v1::StepRecord record;
  record.set_step(run.next_step++);
  record.set_kind(kind);
  record.set_learner_version(step.learner_version());
  record.set_unix_time_ms(NowUnixMs());
  record.set_adapter_sha256(step.adapter_sha256());
  *record.mutable_metrics() = step.metrics();
  *record.mutable_replica_hashes() = step.replica_hashes();
  record.set_replicas_equal(step.replicas_equal());
  RecordStepMetrics(options_.metrics, run.run.run_id(), kind, step.metrics(), step.learner_version(),
                    on_mesh() ? (step.replicas_equal() ? 1 : 0) : -1);
  // The record moves into the history (which always keeps the newest) and is read there:
  // only calls holding the run's lock, as this one does, change the history. The watch lock
  // is taken before the view lock is let go, as Watch takes them: a record is either in a new
  // watcher's backlog or reaches the watcher, never both or neither.
  std::unique_lock<std::mutex> view(run.view_mu);
  run.history.push_back(std::move(record));
  while (run.history.size() > std::max<size_t>(1, options_.max_step_history)) run.history.pop_front();
  const v1::StepRecord& stored = run.history.back();
  run.run.set_last_step(stored.step());
  run.run.set_last_step_unix_ms(stored.unix_time_ms());
  std::lock_guard<std::mutex> watch(run.watch_mu);
  view.unlock();
  for (auto& [id, w] : run.watchers) w(stored);
  return stored.step();
}

bool Coordinator::WorkerValidatesAlone(const RunState& run) const {
  return run.ranks.size() == 1 && (*run.ranks[0])->ValidatesBatchesAsCoordinator();
}

bool Coordinator::PassesBatchAsSent(const RunState& run, bool values_needed) const {
  return !values_needed && WorkerValidatesAlone(run) && (*run.ranks[0])->TakesBatchAsSent();
}

absl::StatusOr<std::optional<BatchTotals>> Coordinator::ValidatedTotals(const RunState& run, const CallBatch& batch,
                                                                        const v1::LossConfig& loss_proto,
                                                                        bool own_totals_needed) {
  if (WorkerValidatesAlone(run) && !own_totals_needed) return std::nullopt;
  LORASTEP_ASSIGN_OR_RETURN(LossConfig loss, LossConfigFromProto(loss_proto));
  LORASTEP_RETURN_IF_ERROR(ValidateBatch(batch.datums(), loss, pool_.vocab_size(), options_.limits));
  // The batch-wide denominators travel with it, so a shard normalizes like the whole batch
  // (data-parallel shards on several workers use the same totals).
  return ComputeBatchTotals(batch.datums());
}

v1::MeshCall Coordinator::MeshHeader(const RunState& run, const std::string& request_id, bool check_version) {
  v1::MeshCall mesh;
  mesh.set_request_id(request_id);
  mesh.set_expected_learner_version(check_version ? run.run.learner_version() : -1);
  return mesh;  // generation: stamped inside the fan-out, under the mesh lock
}

absl::Status Coordinator::CheckNotDiverged(const RunState& run) {
  if (run.run.diverged().empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("run '", run.run.run_id(), "' is diverged (", run.run.diverged(),
                                                    "); LoadState a checkpoint to continue"));
}

v1::StepResponse Coordinator::MergeSteps(RunState& run, std::vector<v1::WorkerStepResponse> per_rank) {
  std::string diverged;
  v1::StepResponse resp = split_.MergeSteps(std::move(per_rank), &diverged);
  if (!diverged.empty()) {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_diverged(
        absl::StrCat("replicas diverged after learner_version ", resp.learner_version(), ": ", diverged));
  }
  return resp;
}

absl::Status Coordinator::AfterCommitFailure(RunState& run, const absl::Status& failed) {
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_diverged(absl::StrCat("a rank failed after the commit vote of the step after learner_version ",
                                      run.run.learner_version(), ": ", failed.message()));
  }
  if (!persistence_.journaled()) {
    return absl::DataLossError(absl::StrCat(failed.message(),
                                            "; the run is marked diverged: LoadState a checkpoint to continue"));
  }
  auto restored = persistence_.RestoreInPlace(run);
  if (!restored.ok()) {
    return absl::DataLossError(absl::StrCat(failed.message(), "; restoring the run from its autosave failed (",
                                            restored.status().message(), "): it stays diverged"));
  }
  return absl::DataLossError(absl::StrCat(failed.message(), "; the run was restored from its autosave at learner_version ",
                                          restored->learner_version(), ", next_sequence_id ",
                                          restored->next_sequence_id(), ": retry from there"));
}

void Coordinator::CommitStep(RunState& run, const std::string& method, const std::string& kind,
                             const std::string& request_id, v1::StepResponse* resp) {
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_learner_version(resp->learner_version());
    run.run.set_pending_forward_backward(0);
  }
  resp->set_step(AppendStep(run, kind, *resp));
  Record(run, method, request_id, *resp, /*with_step=*/true);
  run.last_change = std::chrono::steady_clock::now();
  run.step_since_autosave = true;
  persistence_.MaybeAutosave(run, /*force=*/false);
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::ForwardBackward(
    const v1::ForwardBackwardRequest& req, Deadline deadline, const PackedDatumsWire* packed, CancelToken* cancel) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::ForwardBackwardResponse resp;
  const PackedField packed_field{v1::ForwardBackwardRequest::kPackedDatumsFieldNumber, packed};
  LORASTEP_ASSIGN_OR_RETURN(bool replayed, Replay(*run, "ForwardBackward", req.request_id(), req.sequence_id(), req,
                                                  &resp, /*defer_fingerprint=*/true, packed_field));
  if (replayed) return resp;
  FingerprintTask fingerprint(req.run_id(), req, packed_field);
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  LORASTEP_RETURN_IF_ERROR(CheckActivationRecompute(req.activation_recompute()));
  LORASTEP_ASSIGN_OR_RETURN(
      CallBatch batch, CallBatch::Read(req.datums(), req.packed_datums(), packed,
                                       PassesBatchAsSent(*run, /*values_needed=*/req.has_batch_totals())));
  LORASTEP_ASSIGN_OR_RETURN(std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, batch, req.loss(), /*own_totals_needed=*/req.has_batch_totals()));
  LORASTEP_RETURN_IF_ERROR(CheckResponseFits(batch.num_datums(), batch.num_targets(), req.max_response_bytes()));
  // This call is part of a larger batch: its denominators are the whole batch's.
  if (req.has_batch_totals()) LORASTEP_RETURN_IF_ERROR(ApplyWholeBatchTotals(req.batch_totals(), &*totals));
  LORASTEP_RETURN_IF_ERROR(batch.Split(split_));
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank,
      FanOut<v1::WorkerForwardBackwardResponse>(
          *run, run->AllRanks(), [&](int rank, WorkerClient* w) {
            v1::WorkerForwardBackwardRequest wreq;
            wreq.set_run_id(req.run_id());
            *wreq.mutable_loss() = req.loss();
            wreq.set_activation_recompute(req.activation_recompute());
            if (totals) {
              wreq.set_batch_loss_tokens(totals->loss_tokens);
              wreq.set_batch_samples(totals->samples);
            }
            *wreq.mutable_mesh() = mesh;
            mesh_.StampMesh(wreq.mutable_mesh());
            wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max() || cancel != nullptr);
            BatchShard shard = batch.ShardOfRank(split_, rank, deadline);
            shard.cancel = cancel;
            return w->ForwardBackward(wreq, shard);
          }));
  resp = split_.MergeForward(batch.shards(), batch.num_datums(), per_rank);
  {
    std::lock_guard<std::mutex> view(run->view_mu);
    run->run.set_pending_forward_backward(run->run.pending_forward_backward() + 1);
  }
  run->current_fingerprint = fingerprint.Get();
  Record(*run, "ForwardBackward", req.request_id(), resp);
  return resp;
}

absl::StatusOr<v1::ForwardBackwardResponse> Coordinator::Forward(const v1::ForwardRequest& req, Deadline deadline,
                                                                 const PackedDatumsWire* packed, CancelToken* cancel) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  LORASTEP_ASSIGN_OR_RETURN(CallBatch batch, CallBatch::Read(req.datums(), req.packed_datums(), packed,
                                                             PassesBatchAsSent(*run, /*values_needed=*/false)));
  if (!WorkerValidatesAlone(*run)) {
    LORASTEP_RETURN_IF_ERROR(ValidateForwardBatch(batch.datums(), pool_.vocab_size(), options_.limits));
  }
  LORASTEP_RETURN_IF_ERROR(CheckResponseFits(batch.num_datums(), batch.num_targets(), req.max_response_bytes()));
  LORASTEP_RETURN_IF_ERROR(batch.Split(split_));
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank,
      FanOut<v1::WorkerForwardBackwardResponse>(
          *run, run->AllRanks(), [&](int rank, WorkerClient* w) {
            v1::WorkerForwardRequest wreq;
            wreq.set_run_id(req.run_id());
            wreq.mutable_mesh()->set_expected_learner_version(-1);
            mesh_.StampMesh(wreq.mutable_mesh());
            wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max() || cancel != nullptr);
            BatchShard shard = batch.ShardOfRank(split_, rank, deadline);
            shard.cancel = cancel;
            return w->Forward(wreq, shard);
          }));
  return split_.MergeForward(batch.shards(), batch.num_datums(), per_rank);
}

absl::StatusOr<v1::SampleResponse> Coordinator::Sample(const v1::SampleRequest& req, CancelToken* cancel) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  const ParallelSizes& mesh = options_.mesh;
  if (mesh.pp > 1 || mesh.cp > 1 || mesh.ep > 1) {
    return absl::FailedPreconditionError(
        "Sample: sampling with pp, cp or ep > 1 is not built yet; data-parallel and tensor-parallel meshes sample");
  }
  constexpr int kMaxPrompts = 4096;
  const int prompts = req.prompts_size();
  if (prompts < 1 || prompts > kMaxPrompts) {
    return absl::InvalidArgumentError(absl::StrCat("prompts: ", prompts, " is not in [1, ", kMaxPrompts, "]"));
  }
  // Each data-parallel replica samples a contiguous share of the prompts from its copy of the
  // adapter (every rank of it, on tensor ranks); every sample draws from its own seed, so the
  // answer is the same as one worker's.
  const auto started = std::chrono::steady_clock::now();
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::SampleResponse>(*run, run->AllRanks(), [&](int rank, WorkerClient* w) {
        v1::WorkerSampleRequest wreq;
        wreq.set_run_id(req.run_id());
        wreq.set_base_model(req.base_model());
        wreq.set_checkpoint(req.checkpoint());
        const auto [begin, end] = split_.PromptShareOfRank(prompts, rank);
        for (int i = begin; i < end; ++i) *wreq.add_prompts() = req.prompts(i);
        wreq.set_num_samples(req.num_samples());
        *wreq.mutable_params() = req.params();
        wreq.mutable_mesh()->set_expected_learner_version(-1);
        mesh_.StampMesh(wreq.mutable_mesh());
        wreq.mutable_mesh()->set_client_deadline(cancel != nullptr);
        return w->Sample(wreq, cancel);
      }));
  v1::SampleResponse merged = split_.MergeSamples(prompts, std::move(per_rank));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const auto figure = [&](const char* name) {
    auto it = merged.metrics().find(name);
    return it == merged.metrics().end() ? int64_t{0} : static_cast<int64_t>(it->second);
  };
  {
    std::lock_guard<std::mutex> view(run->view_mu);
    v1::RunSampling* s = run->run.mutable_sampling();
    s->set_calls(s->calls() + 1);
    s->set_sampled_tokens(s->sampled_tokens() + figure("sampled_tokens:sum"));
    s->set_prefill_tokens(s->prefill_tokens() + figure("prefill_tokens:sum"));
    s->set_last_tokens_per_s(seconds > 0 ? static_cast<double>(figure("sampled_tokens:sum")) / seconds : 0);
    s->set_last_unix_ms(NowUnixMs());
  }
  return merged;
}

absl::StatusOr<v1::StepResponse> Coordinator::OptimStep(const v1::OptimStepRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "OptimStep", req.request_id(), req.sequence_id(), req, &resp));
  if (replayed) return resp;
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  LORASTEP_RETURN_IF_ERROR(ValidateClientMetrics(req.client_metrics()));
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  auto per_rank = FanOut<v1::WorkerStepResponse>(*run, run->AllRanks(), [&](int, WorkerClient* w) {
        v1::WorkerOptimStepRequest wreq;
        wreq.set_run_id(req.run_id());
        *wreq.mutable_adamw() = req.adamw();
        *wreq.mutable_mesh() = mesh;
        mesh_.StampMesh(wreq.mutable_mesh());
        return w->OptimStep(wreq);
      });
  if (absl::IsDataLoss(per_rank.status())) return AfterCommitFailure(*run, per_rank.status());
  LORASTEP_RETURN_IF_ERROR(per_rank.status());
  resp = MergeSteps(*run, *std::move(per_rank));
  AddClientMetrics(req.client_metrics(), &resp);
  CommitStep(*run, "OptimStep", "optim_step", req.request_id(), &resp);
  return resp;
}

void Coordinator::StageBatch(const std::string& run_id, PackedDatumsWire* packed, bool values_needed) {
  absl::StatusOr<RunRef> run = runs_.Find(run_id);
  if (!run.ok()) return;  // the call itself says so
  std::unique_lock<std::mutex> lock((*run)->mu, std::try_to_lock);
  if (!lock.owns_lock() || !PassesBatchAsSent(**run, values_needed)) return;
  (*(*run)->ranks[0])->StageBatch(packed);
}

absl::StatusOr<v1::StepResponse> Coordinator::TrainStep(const v1::TrainStepRequest& req, Deadline deadline,
                                                        const PackedDatumsWire* packed, CancelToken* cancel) {
  MarkHop("coordinator_in", req.run_id());
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::StepResponse resp;
  const PackedField packed_field{v1::TrainStepRequest::kPackedDatumsFieldNumber, packed};
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "TrainStep", req.request_id(), req.sequence_id(), req, &resp,
                                   /*defer_fingerprint=*/true, packed_field));
  if (replayed) return resp;
  FingerprintTask fingerprint(req.run_id(), req, packed_field);
  LORASTEP_RETURN_IF_ERROR(CheckNotDiverged(*run));
  if (req.max_tokens_per_microbatch() < 0) {
    return absl::InvalidArgumentError("max_tokens_per_microbatch: must be >= 0");
  }
  LORASTEP_RETURN_IF_ERROR(CheckActivationRecompute(req.activation_recompute()));
  LORASTEP_RETURN_IF_ERROR(AdamWParamsFromProto(req.adamw()).status());
  LORASTEP_RETURN_IF_ERROR(ValidateClientMetrics(req.client_metrics()));
  LORASTEP_ASSIGN_OR_RETURN(CallBatch batch, CallBatch::Read(req.datums(), req.packed_datums(), packed,
                                                             PassesBatchAsSent(*run, /*values_needed=*/false)));
  LORASTEP_ASSIGN_OR_RETURN(const std::optional<BatchTotals> totals,
                            ValidatedTotals(*run, batch, req.loss(), /*own_totals_needed=*/false));
  LORASTEP_RETURN_IF_ERROR(batch.Split(split_));
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), true);
  auto per_rank = FanOut<v1::WorkerStepResponse>(*run, run->AllRanks(), [&](int rank, WorkerClient* w) {
        v1::WorkerTrainStepRequest wreq;
        wreq.set_run_id(req.run_id());
        *wreq.mutable_loss() = req.loss();
        *wreq.mutable_adamw() = req.adamw();
        if (totals) {
          wreq.set_batch_loss_tokens(totals->loss_tokens);
          wreq.set_batch_samples(totals->samples);
        }
        wreq.set_max_tokens_per_microbatch(req.max_tokens_per_microbatch());
        wreq.set_activation_recompute(req.activation_recompute());
        *wreq.mutable_mesh() = mesh;
        mesh_.StampMesh(wreq.mutable_mesh());
        wreq.mutable_mesh()->set_client_deadline(deadline != Deadline::max() || cancel != nullptr);
        BatchShard shard = batch.ShardOfRank(split_, rank, deadline);
        shard.cancel = cancel;
        return w->TrainStep(wreq, shard);
      });
  MarkHop("coordinator_worker_answered", req.run_id());
  if (absl::IsDataLoss(per_rank.status())) return AfterCommitFailure(*run, per_rank.status());
  LORASTEP_RETURN_IF_ERROR(per_rank.status());
  resp = MergeSteps(*run, *std::move(per_rank));
  AddClientMetrics(req.client_metrics(), &resp);
  run->current_fingerprint = fingerprint.Get();
  CommitStep(*run, "TrainStep", "train_step", req.request_id(), &resp);
  MarkHop("coordinator_out", req.run_id());
  return resp;
}

absl::StatusOr<v1::WorkerPathResponse> Coordinator::PathCallOnEveryRank(
    RunState& run, const std::string& run_id, const std::string& path, const v1::MeshCall* mesh,
    const std::function<absl::StatusOr<v1::WorkerPathResponse>(WorkerClient*, v1::WorkerPathRequest)>& send) {
  LORASTEP_ASSIGN_OR_RETURN(
      auto per_rank, FanOut<v1::WorkerPathResponse>(run, run.AllRanks(), [&](int, WorkerClient* w) {
        v1::WorkerPathRequest wreq = PathRequest(run_id, path);
        if (mesh != nullptr) *wreq.mutable_mesh() = *mesh;
        mesh_.StampMesh(wreq.mutable_mesh());
        return send(w, std::move(wreq));
      }));
  return std::move(per_rank[0]);
}

absl::StatusOr<v1::SaveStateResponse> Coordinator::SaveState(const v1::SaveStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(persistence_.CheckNotAutosavePath(req.run_id(), req.path(), "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  // Every rank takes part (tensor ranks gather their slices); rank 0 writes one
  // layout-independent checkpoint, the same as at world size 1.
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse first,
                            PathCallOnEveryRank(*run, req.run_id(), req.path(), nullptr,
                                                [](WorkerClient* w, const v1::WorkerPathRequest& wreq) {
                                                  return w->SaveState(wreq);
                                                }));
  v1::SaveStateResponse resp;
  resp.set_path(req.path());
  resp.set_learner_version(first.learner_version());
  return resp;
}

absl::StatusOr<v1::Run> Coordinator::LoadState(const v1::LoadStateRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  v1::Run resp;
  LORASTEP_ASSIGN_OR_RETURN(bool replayed,
                            Replay(*run, "LoadState", req.request_id(), req.sequence_id(), req, &resp));
  if (replayed) return resp;
  const v1::MeshCall mesh = MeshHeader(*run, req.request_id(), false);
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse first,
                            PathCallOnEveryRank(*run, req.run_id(), req.path(), &mesh,
                                                [&](WorkerClient* w, v1::WorkerPathRequest wreq) {
                                                  wreq.set_weights_only(req.weights_only());
                                                  return w->LoadState(wreq);
                                                }));
  {
    std::lock_guard<std::mutex> view(run->view_mu);
    run->run.set_learner_version(first.learner_version());
    run->run.set_pending_forward_backward(0);
    run->run.clear_diverged();  // every rank now holds the checkpoint's state
  }
  Record(*run, "LoadState", req.request_id(), run->run);  // bumps next_sequence_id
  resp = run->run;
  persistence_.MaybeAutosave(*run, /*force=*/true);  // the loaded state is what a restart resumes
  return resp;
}

absl::StatusOr<v1::ExportAdapterResponse> Coordinator::ExportAdapter(
    const v1::ExportAdapterRequest& req) {
  if (req.path().empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(persistence_.CheckNotAutosavePath(req.run_id(), req.path(), "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerPathResponse first,
                            PathCallOnEveryRank(*run, req.run_id(), req.path(), nullptr,
                                                [&](WorkerClient* w, v1::WorkerPathRequest wreq) {
                                                  wreq.set_expand_experts(req.expand_experts());
                                                  return w->ExportAdapter(wreq);
                                                }));
  v1::ExportAdapterResponse resp;
  resp.set_path(req.path());
  resp.set_adapter_sha256(first.adapter_sha256());
  resp.set_learner_version(first.learner_version());
  return resp;
}

absl::StatusOr<v1::UploadAdapterResponse> Coordinator::UploadAdapter(const std::string& run_id, const std::string& path,
                                                                     const std::string& adapter_config,
                                                                     const std::string& adapter_model, bool replace) {
  if (path.empty()) return absl::InvalidArgumentError("path: required");
  LORASTEP_RETURN_IF_ERROR(persistence_.CheckNotAutosavePath(run_id, path, "path"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(run_id));
  std::lock_guard<std::mutex> lock(run->mu);
  // Rank 0 writes the state store (a mesh's ranks share one).
  LORASTEP_ASSIGN_OR_RETURN(auto per_rank, FanOut<v1::WorkerPathResponse>(*run, {0}, [&](int, WorkerClient* w) {
    v1::WorkerStoreAdapterRequest wreq;
    wreq.set_run_id(run_id);
    wreq.set_path(path);
    wreq.set_adapter_config(adapter_config);
    wreq.set_adapter_model(adapter_model);
    wreq.set_replace(replace);
    mesh_.StampMesh(wreq.mutable_mesh());
    return w->StoreAdapter(wreq);
  }));
  v1::UploadAdapterResponse resp;
  resp.set_path(path);
  resp.set_bytes(static_cast<int64_t>(adapter_config.size() + adapter_model.size()));
  return resp;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  LORASTEP_ASSIGN_OR_RETURN(auto per_rank, FanOut<v1::ListCheckpointsResponse>(
                                               *run, {0}, [&](int, WorkerClient* w) { return w->ListCheckpoints(req); }));
  return per_rank[0];
}

absl::Status Coordinator::DeleteCheckpoint(const v1::DeleteCheckpointRequest& req) {
  LORASTEP_RETURN_IF_ERROR(persistence_.CheckNotAutosaveName(req.run_id(), req.name(), "name"));
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->mu);  // not while a SaveState of this run writes
  return FanOut<bool>(*run, {0}, [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
           LORASTEP_RETURN_IF_ERROR(w->DeleteCheckpoint(req));
           return true;
         }).status();
}

absl::StatusOr<v1::GetStepMetricsResponse> Coordinator::GetStepMetrics(
    const v1::GetStepMetricsRequest& req) {
  if (req.limit() < 0) return absl::InvalidArgumentError("limit: must be >= 0");
  LORASTEP_ASSIGN_OR_RETURN(auto run, runs_.Find(req.run_id()));
  std::lock_guard<std::mutex> lock(run->view_mu);
  v1::GetStepMetricsResponse resp;
  for (const auto& r : run->history) {
    if (r.step() < req.since_step()) continue;
    if (req.limit() > 0 && resp.steps_size() >= req.limit()) break;
    *resp.add_steps() = r;
  }
  return resp;
}

absl::StatusOr<int64_t> Coordinator::Watch(const std::string& run_id, int64_t since_step, Watcher watcher,
                                           const std::function<void(std::vector<v1::StepRecord>)>& backlog) {
  LORASTEP_ASSIGN_OR_RETURN(RunRef run, runs_.Find(run_id));
  // The view lock orders this against AppendStep (which takes the watch lock before letting
  // the view lock go): records before registration are in the backlog, later ones reach the
  // watcher, after the backlog. It never waits for a step in progress.
  std::unique_lock<std::mutex> view(run->view_mu);
  std::vector<v1::StepRecord> kept;
  for (const auto& r : run->history) {
    if (r.step() >= since_step) kept.push_back(r);
  }
  std::lock_guard<std::mutex> watch(run->watch_mu);
  view.unlock();
  backlog(std::move(kept));
  const int64_t id = run->next_watch_id++;
  run->watchers[id] = std::move(watcher);
  return id;
}

void Coordinator::Unwatch(const std::string& run_id, int64_t watch_id) {
  auto run = runs_.Find(run_id);
  if (!run.ok()) return;
  std::lock_guard<std::mutex> watch((*run)->watch_mu);
  (*run)->watchers.erase(watch_id);
}

}  // namespace lorastep
