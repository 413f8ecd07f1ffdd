#include "worker/worker_core.h"

#include <malloc.h>

#include <algorithm>
#include <type_traits>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "lib/hop_trace.h"
#include "lib/io/checkpoint_dir.h"
#include "lib/io/file_util.h"
#include "lib/log.h"
#include "lib/run_tenant.h"
#include "lib/status_macros.h"

namespace lorastep {

int64_t ActivationBytesFromMb(double mb) { return mb < 0 ? -1 : static_cast<int64_t>(mb * 1024 * 1024); }

void ProfileFromEnvironment(WorkerOptions* options) {
  if (const char* trace = std::getenv("LORASTEP_PROFILE_TRACE")) {
    options->profile_trace_path = trace;
    const char* step = std::getenv("LORASTEP_PROFILE_STEP");
    options->profile_train_step = step != nullptr ? std::atoll(step) : 2;
  }
}

absl::StatusOr<std::unique_ptr<WorkerCore>> WorkerCore::Create(const WorkerOptions& options) {
  LORASTEP_ASSIGN_OR_RETURN(ParallelLayout layout,
                            ParallelLayout::Create(options.sizes, options.sizes.world()));
  LORASTEP_ASSIGN_OR_RETURN(std::shared_ptr<const BaseModel> base,
                            LoadBaseModel(options.model_path, options.device, options.dtype,
                                          options.sizes, layout.Coords(options.rank)));
  auto core = std::unique_ptr<WorkerCore>(new WorkerCore(options, std::move(base)));
  if (options.faults != nullptr) core->ranked_faults_ = std::make_unique<RankedFaultPoints>(options.faults, options.rank);
  if (!options.state_dir.empty()) {
    LORASTEP_ASSIGN_OR_RETURN(StateStore store, StateStore::Open(options.state_dir));
    core->store_ = std::make_unique<StateStore>(std::move(store));
  }
  if (layout.world_size() > 1) {
    if (options.rendezvous.empty()) {
      return absl::InvalidArgumentError("rendezvous: required when tp * pp * dp > 1");
    }
    ProcessGroupsOptions g;
    g.store_address = options.rendezvous;
    g.store_transport_for = options.store_transport_for;
    g.store_key_prefix = options.rendezvous_key_prefix;
    g.rank = options.rank;
    g.layout = layout;
    g.device = core->base_->device.str();
    g.timeout = options.collective_timeout;
    g.gloo_host = options.gloo_host;
    // Formed by the first mesh call, at the generation the coordinator is at: this process
    // may be replacing a dead rank of a mesh whose survivors are past generation 0.
    g.defer_communicators = true;
    LORASTEP_ASSIGN_OR_RETURN(core->groups_, ProcessGroups::Create(g));
  }
  return core;
}

namespace {

// `status` with the state store's folder named as the client's reference: a caller learns
// neither the server's file system layout nor its run ids.
absl::Status AsReference(const absl::Status& status, const std::string& folder, const std::string& ref) {
  if (status.ok() || folder == ref || folder.empty()) return status;
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(), {{folder, ref}}));
}

}  // namespace

absl::StatusOr<Trainer*> WorkerCore::Prepare(const std::string& run_id, const MeshCallInfo& mesh) {
  // The communicators first: a rank that refuses below still votes on them.
  LORASTEP_RETURN_IF_ERROR(FormGroups(mesh));
  LORASTEP_ASSIGN_OR_RETURN(Trainer * t, Find(run_id));
  if (mesh.expected_learner_version >= 0 && mesh.expected_learner_version != t->learner_version()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "learner_version: rank ", options_.rank, " of run '", run_id, "' is at ",
        t->learner_version(), ", the coordinator expected ", mesh.expected_learner_version));
  }
  return t;
}

absl::Status WorkerCore::AdmissionFault(const char* call) {
  return AtFaultPoint(ranked_faults_.get(), absl::StrCat("Admit", call));
}

absl::StatusOr<Trainer*> WorkerCore::Admit(const std::string& run_id, const MeshCallInfo& mesh, const char* call) {
  absl::StatusOr<Trainer*> t = Prepare(run_id, mesh);
  if (t.ok()) {
    if (absl::Status refused = AdmissionFault(call); !refused.ok()) t = refused;
  }
  if (!t.ok() && groups_ != nullptr && !groups_->broken()) {
    // The other ranks' trainers vote at admission: this rank's "no" stops them all there.
    return AgreeOnMesh(groups_.get(), base_->device, t.status());
  }
  return t;
}

absl::Status WorkerCore::FormGroups(const MeshCallInfo& mesh) {
  if (groups_ == nullptr) return absl::OkStatus();
  if (!mesh.rendezvous.empty()) LORASTEP_RETURN_IF_ERROR(groups_->MoveStore(mesh.rendezvous));
  if (mesh.generation == groups_->generation() && !groups_->broken()) return absl::OkStatus();
  return groups_->Rebuild(static_cast<int>(mesh.generation));
}

size_t WorkerCore::num_runs() const {
  std::lock_guard<FairMutex> lock(mu_);
  return runs_.size();
}

absl::StatusOr<Trainer*> WorkerCore::Find(const std::string& run_id) {
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  return it->second.get();
}

absl::StatusOr<int64_t> WorkerCore::CreateRun(const std::string& run_id, const LoraConfig& lora,
                                              uint64_t seed, const std::string& init_from,
                                              bool init_with_optimizer, const MeshCallInfo& mesh) {
  std::lock_guard<FairMutex> lock(mu_);
  // Before anything that may differ between ranks (the run existing): the load is collective,
  // and one vote settles it (a rank that fails on its own votes "no" as it returns).
  std::optional<MeshVote> vote;
  if (!init_from.empty()) {
    LORASTEP_RETURN_IF_ERROR(FormGroups(mesh));
    vote.emplace(groups_.get(), base_->device);
    LORASTEP_RETURN_IF_ERROR(AdmissionFault("CreateRun"));
  }
  if (runs_.count(run_id)) {
    return absl::AlreadyExistsError(absl::StrCat("run_id: '", run_id, "' exists"));
  }
  TrainerOptions o;
  o.lora = lora;
  o.seed = seed;
  o.grad = options_.grad;
  o.max_tokens_per_microbatch = options_.max_tokens_per_microbatch;
  o.pack_sequences = options_.pack_sequences;
  o.logprob_chunk_tokens = options_.logprob_chunk_tokens;
  o.groups = groups_.get();
  o.finalize = options_.finalize;
  o.profile_trace_path = options_.profile_trace_path;
  o.profile_train_step = options_.profile_train_step;
  o.max_activation_bytes = options_.max_activation_bytes;
  o.activation_recompute = options_.activation_recompute;
  o.faults = ranked_faults_.get();
  LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(base_, o));
  if (!init_from.empty()) {
    LORASTEP_RETURN_IF_ERROR(InitRun(trainer.get(), run_id, init_from, init_with_optimizer, &*vote));
  }
  const int64_t version = trainer->learner_version();
  {
    std::lock_guard<std::mutex> q(queue_mu_);
    coschedulable_[run_id] = trainer->CoSchedulable();
    if (coschedulable_[run_id]) expected_runs_.insert(run_id);  // a new run is presumed active
  }
  runs_[run_id] = std::move(trainer);
  return version;
}

absl::Status WorkerCore::InitRun(Trainer* trainer, const std::string& run_id, const std::string& init_from,
                                 bool with_optimizer, MeshVote* vote) const {
  auto prefixed = [](const absl::Status& s) {
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat("init_from: ", s.message()));
  };
  auto folder = ResolvePath(run_id, init_from, /*write=*/false);
  if (!folder.ok()) return prefixed(folder.status());
  if (PathExists(*folder + "/adapter_config.json")) {  // a PEFT adapter: weights only
    if (with_optimizer) {
      return absl::InvalidArgumentError("init_with_optimizer: a PEFT adapter has no optimizer state; "
                                        "start from a SaveState checkpoint for that");
    }
    LORASTEP_RETURN_IF_ERROR(prefixed(AsReference(trainer->ImportAdapter(*folder), *folder, init_from)));
    return vote->Cast(absl::OkStatus());
  }
  if (!PathExists(*folder + "/trainer_state.json")) {
    return absl::NotFoundError(absl::StrCat("init_from: ", init_from,
                                            " holds neither adapter_config.json (PEFT) nor trainer_state.json (a checkpoint)"));
  }
  LORASTEP_RETURN_IF_ERROR(prefixed(AsReference(trainer->LoadState(*folder, vote), *folder, init_from)));
  if (!with_optimizer) trainer->ResetOptimizer();
  return absl::OkStatus();
}

absl::Status WorkerCore::DeleteRun(const std::string& run_id) {
  std::lock_guard<FairMutex> lock(mu_);
  if (runs_.erase(run_id) == 0) return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  {
    std::lock_guard<std::mutex> q(queue_mu_);
    coschedulable_.erase(run_id);
    expected_runs_.erase(run_id);
    returns_.erase(run_id);
    last_call_tokens_.erase(run_id);
  }
  malloc_trim(0);  // the run's adapter and optimizer state go back to the OS
  return absl::OkStatus();
}

template <typename Result>
absl::StatusOr<Result> WorkerCore::RunBatchCall(CallKind kind, const char* name, const std::string& run_id,
                                                JointTrainCall call, std::optional<ActivationRecompute> recompute,
                                                const MeshCallInfo& mesh, const Cancelled& cancelled,
                                                absl::FunctionRef<absl::StatusOr<Result>(Trainer*, const BatchOptions&)> alone) {
  if (groups_ == nullptr && CoSchedules(run_id, recompute)) {
    call.cancelled = cancelled;
    QueuedStep step{&run_id, kind, std::move(call), mesh, cancelled, std::chrono::steady_clock::now()};
    AwaitCoscheduled(&step);
    if constexpr (std::is_same_v<Result, OptimStepResult>) {
      return std::move(step.result);
    } else {
      return std::move(step.forward);
    }
  }
  std::lock_guard<FairMutex> lock(mu_);
  // A call its caller gave up on while it waited for the device is dropped before anything
  // (forming communicators included): a rank slowed down (stopped, then resumed) would
  // otherwise work through every abandoned retry, each failing slowly against a mesh
  // generation its peers have left, and never catch up with the next live call.
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat(name, ": cancelled (its caller went away or its deadline passed) "
                                             "before it reached the device; nothing was applied"));
  }
  LORASTEP_ASSIGN_OR_RETURN(Trainer * t, Admit(run_id, mesh, name));
  BatchOptions batch;
  batch.totals = call.totals;
  batch.max_tokens_per_microbatch = call.max_tokens_per_microbatch;
  batch.activation_recompute = recompute;
  batch.cancelled = cancelled;
  batch.agree_on_cancel = mesh.agree_on_cancel;
  return alone(t, batch);
}

absl::StatusOr<ForwardBackwardResult> WorkerCore::ForwardBackward(
    const std::string& run_id, const std::vector<Datum>& datums, const LossConfig& loss,
    const BatchTotals* totals, std::optional<ActivationRecompute> recompute,
    const MeshCallInfo& mesh, const Cancelled& cancelled) {
  return RunBatchCall<ForwardBackwardResult>(
      CallKind::kForwardBackward, "ForwardBackward", run_id,
      JointTrainCall{nullptr, &datums, &loss, AdamWParams{}, 0, totals, nullptr}, recompute, mesh, cancelled,
      [&](Trainer* t, const BatchOptions& batch) { return t->ForwardBackward(datums, loss, batch); });
}

absl::StatusOr<ForwardBackwardResult> WorkerCore::Forward(const std::string& run_id,
                                                          const std::vector<Datum>& datums,
                                                          const MeshCallInfo& mesh, const Cancelled& cancelled) {
  return RunBatchCall<ForwardBackwardResult>(
      CallKind::kForward, "Forward", run_id, JointTrainCall{nullptr, &datums, nullptr, AdamWParams{}, 0, nullptr, nullptr},
      std::nullopt, mesh, cancelled, [&](Trainer* t, const BatchOptions& batch) { return t->Forward(datums, batch); });
}

absl::StatusOr<OptimStepResult> WorkerCore::OptimStep(const std::string& run_id,
                                                      const AdamWParams& params,
                                                      const MeshCallInfo& mesh) {
  std::lock_guard<FairMutex> lock(mu_);
  LORASTEP_ASSIGN_OR_RETURN(Trainer * t, Admit(run_id, mesh, "OptimStep"));
  return t->OptimStep(params);
}

absl::StatusOr<OptimStepResult> WorkerCore::TrainStep(const std::string& run_id,
                                                      const std::vector<Datum>& datums,
                                                      const LossConfig& loss,
                                                      const AdamWParams& params,
                                                      const BatchTotals* totals,
                                                      int64_t max_tokens,
                                                      std::optional<ActivationRecompute> recompute,
                                                      const MeshCallInfo& mesh, const Cancelled& cancelled) {
  return RunBatchCall<OptimStepResult>(
      CallKind::kTrainStep, "TrainStep", run_id,
      JointTrainCall{nullptr, &datums, &loss, params, max_tokens, totals, nullptr}, recompute, mesh, cancelled,
      [&](Trainer* t, const BatchOptions& batch) { return t->TrainStep(datums, loss, params, batch); });
}

bool WorkerCore::CoSchedules(const std::string& run_id, std::optional<ActivationRecompute> recompute) {
  if (options_.coschedule_window.count() <= 0 || recompute.has_value()) return false;
  std::lock_guard<std::mutex> q(queue_mu_);
  auto it = coschedulable_.find(run_id);
  if (it == coschedulable_.end() || !it->second) return false;
  // A lone co-schedulable run has no one to share a step with: its calls skip the queue and
  // the hand-off to the co-scheduling thread.
  return std::count_if(coschedulable_.begin(), coschedulable_.end(), [](const auto& e) { return e.second; }) > 1;
}

WorkerCore::~WorkerCore() {
  {
    std::lock_guard<std::mutex> q(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (scheduler_.joinable()) scheduler_.join();
}

void WorkerCore::AwaitCoscheduled(QueuedStep* step) {
  std::call_once(scheduler_started_, [this] { scheduler_ = std::thread([this] { CoscheduleLoop(); }); });
  MarkHop("worker_queued", *step->run_id);
  std::unique_lock<std::mutex> q(queue_mu_);
  queue_.push_back(step);
  returns_[*step->run_id].Arrived(step->queued);
  queue_cv_.notify_one();  // the scheduler, idle or in its window, counts the runs queued
  done_cv_.wait(q, [step] { return step->done; });
}

void WorkerCore::CoscheduleLoop() {
  std::unique_lock<std::mutex> q(queue_mu_);
  while (true) {
    queue_cv_.wait(q, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left to run
    q.unlock();
    LeadCoscheduledStep();
    q.lock();
  }
}

void WorkerCore::RunCoscheduled(CallKind kind, const std::vector<QueuedStep*>& steps) {
  if (steps.empty()) return;
  if (steps.size() == 1) {  // alone: the run's own call, exactly as without co-scheduling
    QueuedStep& s = *steps.front();
    const JointTrainCall& c = s.call;
    BatchOptions batch;
    batch.totals = c.totals;
    batch.max_tokens_per_microbatch = c.max_tokens_per_microbatch;
    batch.cancelled = s.cancelled;
    switch (kind) {
      case CallKind::kTrainStep:
        s.result = c.trainer->TrainStep(*c.datums, *c.loss, c.adamw, batch);
        return;
      case CallKind::kForwardBackward:
        s.forward = c.trainer->ForwardBackward(*c.datums, *c.loss, batch);
        return;
      case CallKind::kForward:
        s.forward = c.trainer->Forward(*c.datums, batch);
        return;
    }
  }
  std::vector<JointTrainCall> calls;
  for (const QueuedStep* s : steps) calls.push_back(s->call);
  if (kind == CallKind::kTrainStep) {
    std::vector<absl::StatusOr<OptimStepResult>> results = Trainer::JointTrainStep(calls);
    for (size_t i = 0; i < steps.size(); ++i) steps[i]->result = std::move(results[i]);
    return;
  }
  std::vector<absl::StatusOr<ForwardBackwardResult>> results;
  if (kind == CallKind::kForwardBackward) {
    results = Trainer::JointForwardBackward(calls);
  } else {
    std::vector<JointForwardCall> forwards;
    for (const JointTrainCall& c : calls) forwards.push_back({c.trainer, c.datums, c.cancelled});
    results = Trainer::JointForward(forwards);
  }
  for (size_t i = 0; i < steps.size(); ++i) steps[i]->forward = std::move(results[i]);
}

std::map<std::string, int64_t> WorkerCore::ExpectedTenants() {
  // Tenants active without a call queued: those of the last step's runs, and of runs
  // answered within the last 20 windows (a tenant whose client is slow to send again, on a
  // busy host, keeps its share rather than finding a step of every other tenant's runs).
  std::map<std::string, int64_t> expected;
  const auto recent = std::chrono::steady_clock::now() - 20 * options_.coschedule_window;
  for (const auto& [run, tokens] : last_call_tokens_) {
    const auto& answered = returns_[run].answered();
    if (expected_runs_.count(run) == 0 && (!answered.has_value() || *answered < recent)) continue;
    int64_t& share = expected[TenantOfRun(run)];
    share = std::max(share, tokens);
  }
  return expected;
}

std::vector<WaitingCall> WorkerCore::WaitingCalls() const {
  std::vector<WaitingCall> waiting;
  for (const QueuedStep* s : queue_) {
    int64_t tokens = 0;
    for (const Datum& d : *s->call.datums) tokens += static_cast<int64_t>(d.tokens.size());
    waiting.push_back({*s->run_id, TenantOfRun(*s->run_id), tokens});
  }
  return waiting;
}

void WorkerCore::LeadCoscheduledStep() {
  std::chrono::steady_clock::time_point opened;  // when the window opened
  {  // the window: while an expected run (one of the previous step's, or created since) has no
     // call queued, from when the device is free for this step (the runs of the previous step
     // send their next calls as it ends; timed from the first call's arrival instead, a call
     // that waited through that step would open an already closed window and they would miss
     // this step). A run that sent nothing for a step is no longer expected: an idle run costs
     // the others at most one window past their last arrival (the lock-step hold below only
     // keeps calls that already waited through the previous step a little longer).
    std::unique_lock<std::mutex> q(queue_mu_);
    auto awaited_runs = [&] {
      const std::vector<WaitingCall> waiting = WaitingCalls();
      return RunsToAwait(waiting, ShareStep(waiting, ExpectedTenants()), expected_runs_, TenantOfRun);
    };
    // The window stays open `window` past the latest arrival while the expected runs' calls
    // keep coming (their answers and next calls travel back one by one), at most four windows
    // or a tenth of the last step, whichever is longer: a run that misses a step waits a whole
    // step, so on a busy host (many runs' answers and next calls in turn) waiting a little
    // longer for the stragglers costs the others far less than it saves them.
    // Where the previous step's stragglers are queued, expected runs that answer in lock step
    // hold it open a little longer still (CoscheduleWindowClose): the runs of the last step
    // must not lose this one to those stragglers.
    opened = std::chrono::steady_clock::now();
    const auto cap = std::max<std::chrono::steady_clock::duration>(4 * options_.coschedule_window,
                                                                   last_coscheduled_step_ / 10);
    // Only where calls that waited through the previous step are queued: a call that found
    // the device free waits at most the window for runs that do not come.
    const bool stragglers_queued =
        last_coscheduled_end_.has_value() &&
        std::any_of(queue_.begin(), queue_.end(), [&](const QueuedStep* s) { return s->queued < *last_coscheduled_end_; });
    while (!queue_.empty()) {
      const std::vector<std::string> runs = awaited_runs();
      if (runs.empty()) break;
      auto latest = opened;
      for (const QueuedStep* s : queue_) latest = std::max(latest, s->queued);
      std::vector<const RunReturns*> awaited;
      if (stragglers_queued) {
        for (const std::string& run : runs) awaited.push_back(&returns_[run]);
      }
      const auto close = CoscheduleWindowClose(opened, options_.coschedule_window, cap, latest, awaited);
      if (std::chrono::steady_clock::now() >= close) break;
      queue_cv_.wait_until(q, close);
    }
  }
  std::lock_guard<FairMutex> device(mu_);
  std::vector<QueuedStep*> taken;
  int64_t missed = 0;  // expected runs with no call in this step (stragglers, or idle runs)
  {  // arrival order, one call per run, each tenant within its share of the step
     // (ShareStep, TakeForStep; JointTrainStep packs them into rows that fit the activation budget); a
     // run's next call waits for the next step
    std::lock_guard<std::mutex> q(queue_mu_);
    const std::vector<WaitingCall> waiting = WaitingCalls();
    const StepChoice choice = TakeForStep(waiting, ShareStep(waiting, ExpectedTenants()), last_step_heavy_);
    last_step_heavy_ = choice.heavy;
    std::set<std::string> runs_taken;
    std::vector<bool> take(queue_.size(), false);
    for (size_t i : choice.taken) {
      take[i] = true;
      runs_taken.insert(waiting[i].run);
      last_call_tokens_[waiting[i].run] = waiting[i].tokens;
    }
    std::deque<QueuedStep*> left;
    for (size_t i = 0; i < queue_.size(); ++i) {
      if (take[i]) {
        taken.push_back(queue_[i]);
      } else {
        left.push_back(queue_[i]);
      }
    }
    queue_ = std::move(left);
    for (const std::string& run : expected_runs_) missed += runs_taken.count(run) == 0 ? 1 : 0;
    expected_runs_ = runs_taken;  // the runs likely to send again as this step ends
  }
  // From the window's opening to the last taken call's arrival (0 when all were queued before).
  auto last_arrival = opened;
  for (const QueuedStep* s : taken) last_arrival = std::max(last_arrival, s->queued);
  const double arrivals = std::chrono::duration<double>(last_arrival - opened).count();
  std::vector<QueuedStep*> trains, forwards, forward_backwards;
  for (QueuedStep* s : taken) {
    const char* method = s->kind == CallKind::kTrainStep         ? "TrainStep"
                         : s->kind == CallKind::kForwardBackward ? "ForwardBackward"
                                                                 : "Forward";
    absl::StatusOr<Trainer*> t = Admit(*s->run_id, s->mesh, method);
    if (t.ok() && s->cancelled && s->cancelled()) {
      t = absl::CancelledError("call cancelled (its caller went away or its deadline passed) before it ran; "
                               "nothing was applied");
    }
    if (!t.ok()) {
      s->forward = t.status();
      s->result = t.status();
      continue;
    }
    s->call.trainer = *t;
    (s->kind == CallKind::kTrainStep ? trains : s->kind == CallKind::kForward ? forwards : forward_backwards)
        .push_back(s);
  }
  // From the first taken call's arrival until its shared step began.
  const double waited = taken.empty() ? 0.0
                                      : std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                                      taken.front()->queued).count();
  const auto step_began = std::chrono::steady_clock::now();
  AtFaultPoint(ranked_faults_.get(), "CoscheduledStepBegan").IgnoreError();
  RunCoscheduled(CallKind::kForward, forwards);
  RunCoscheduled(CallKind::kForwardBackward, forward_backwards);
  RunCoscheduled(CallKind::kTrainStep, trains);
  AtFaultPoint(ranked_faults_.get(), "CoscheduledStepEnded").IgnoreError();
  // From the previous shared step's end to this one's start: answers out, next calls in, the
  // window (and the device time of calls that ran alone meanwhile, if any).
  const double between_steps =
      last_coscheduled_end_.has_value() ? std::chrono::duration<double>(step_began - *last_coscheduled_end_).count() : 0.0;
  last_coscheduled_end_ = std::chrono::steady_clock::now();
  last_coscheduled_step_ = *last_coscheduled_end_ - step_began;
  for (QueuedStep* s : taken) {
    if (s->kind == CallKind::kTrainStep ? s->result.ok() : s->forward.ok()) {
      Metrics& m = s->kind == CallKind::kTrainStep ? s->result->metrics : s->forward->metrics;
      m.Add("time_coschedule_wait_s:sum", waited);
      m.Add("time_coschedule_last_arrival_s:sum", arrivals);
      if (between_steps > 0) m.Add("time_coschedule_between_steps_s:sum", between_steps);
      m.Add("co_scheduled_missed_runs:max", static_cast<double>(missed));
    }
  }
  for (const QueuedStep* s : taken) MarkHop("worker_step_done", *s->run_id);
  std::lock_guard<std::mutex> q(queue_mu_);
  const auto answered = std::chrono::steady_clock::now();
  for (QueuedStep* s : taken) {
    s->done = true;
    returns_[*s->run_id].Answered(answered);
  }
  done_cv_.notify_all();
}

absl::StatusOr<WorkerCore::GatherAdmitted> WorkerCore::AdmitGather(const std::string& run_id, const std::string& path,
                                                                    const MeshCallInfo& mesh, const char* call) {
  LORASTEP_RETURN_IF_ERROR(FormGroups(mesh.Unchecked()));
  MeshVote vote(groups_.get(), base_->device);  // an early return below votes "no"
  GatherAdmitted admitted;
  LORASTEP_ASSIGN_OR_RETURN(admitted.folder, ResolvePath(run_id, path, /*write=*/true));
  LORASTEP_ASSIGN_OR_RETURN(admitted.trainer, Prepare(run_id, mesh.Unchecked()));
  LORASTEP_RETURN_IF_ERROR(AdmissionFault(call));
  LORASTEP_RETURN_IF_ERROR(vote.Cast(absl::OkStatus()));
  return admitted;
}

absl::StatusOr<WorkerCore::PathResult> WorkerCore::SaveState(const std::string& run_id,
                                                             const std::string& path,
                                                             const MeshCallInfo& mesh, bool background) {
  std::lock_guard<FairMutex> lock(mu_);
  LORASTEP_ASSIGN_OR_RETURN(GatherAdmitted admitted, AdmitGather(run_id, path, mesh, "SaveState"));
  Trainer* t = admitted.trainer;
  const std::string folder = admitted.folder;
  if (background) {
    LORASTEP_ASSIGN_OR_RETURN(std::shared_ptr<const TrainerStateSnapshot> snapshot, t->SnapshotState());
    writer_.Submit(folder, [snapshot, folder, path, faults = ranked_faults_.get()] {
      absl::Status s = AtFaultPoint(faults, "BackgroundWrite");
      if (s.ok()) s = AsReference(Trainer::WriteStateSnapshot(*snapshot, folder), folder, path);
      if (!s.ok()) LORASTEP_LOG(Error) << "background SaveState of " << path << ": " << s;
      return s;
    });
    return PathResult{"", t->learner_version()};
  }
  LORASTEP_RETURN_IF_ERROR(AsReference(t->SaveState(folder), folder, path));
  return PathResult{t->FullAdapterSha256(), t->learner_version()};
}

absl::Status WorkerCore::AwaitSaved(const std::string& run_id, const std::string& path) {
  LORASTEP_ASSIGN_OR_RETURN(std::string folder, ResolvePath(run_id, path, /*write=*/true));
  if (std::optional<absl::Status> outcome = writer_.Await(folder)) return *outcome;
  if (!PathExists(folder)) return absl::NotFoundError(absl::StrCat("path: ", path, ": nothing is saved under that reference"));
  return absl::OkStatus();
}

absl::StatusOr<WorkerCore::PathResult> WorkerCore::LoadState(const std::string& run_id,
                                                             const std::string& path,
                                                             const MeshCallInfo& mesh, bool weights_only) {
  std::lock_guard<FairMutex> lock(mu_);
  writer_.Await(ResolveRequestPath(store_.get(), path, "path").value_or(""));  // a write there finishes first
  // One vote on every path once the communicators are formed: a rank that fails on its own
  // (the path, the run, a value in its shard) votes "no" as it returns.
  LORASTEP_RETURN_IF_ERROR(FormGroups(mesh.Unchecked()));
  MeshVote vote(groups_.get(), base_->device);
  LORASTEP_ASSIGN_OR_RETURN(std::string folder, ResolvePath(run_id, path, /*write=*/false));
  LORASTEP_ASSIGN_OR_RETURN(Trainer * t, Prepare(run_id, mesh.Unchecked()));
  LORASTEP_RETURN_IF_ERROR(AdmissionFault("LoadState"));
  LORASTEP_RETURN_IF_ERROR(AsReference(t->LoadState(folder, &vote), folder, path));
  if (weights_only) t->ResetOptimizer();
  return PathResult{t->FullAdapterSha256(), t->learner_version()};
}

absl::StatusOr<WorkerCore::PathResult> WorkerCore::ExportAdapter(const std::string& run_id,
                                                                 const std::string& path,
                                                                 const MeshCallInfo& mesh,
                                                                 bool expand_experts) {
  std::lock_guard<FairMutex> lock(mu_);
  LORASTEP_ASSIGN_OR_RETURN(GatherAdmitted admitted, AdmitGather(run_id, path, mesh, "ExportAdapter"));
  Trainer* t = admitted.trainer;
  const std::string& folder = admitted.folder;
  LORASTEP_RETURN_IF_ERROR(AsReference(t->ExportAdapter(folder, expand_experts), folder, path));
  return PathResult{t->FullAdapterSha256(), t->learner_version()};
}

absl::StatusOr<WorkerCore::PathResult> WorkerCore::StoreAdapter(const std::string& run_id, const std::string& path,
                                                                const std::string& adapter_config,
                                                                const std::string& adapter_model, bool replace) {
  std::lock_guard<FairMutex> lock(mu_);
  if (options_.sizes.world() > 1) {
    return absl::FailedPreconditionError(
        "UploadAdapter: a PEFT adapter loads at world size 1 only (as init_from does); upload it to a coordinator "
        "with one worker, start a run from it and SaveState a checkpoint the mesh can load");
  }
  LORASTEP_ASSIGN_OR_RETURN(std::string folder, ResolvePath(run_id, path, /*write=*/true));
  LORASTEP_ASSIGN_OR_RETURN(Trainer * run, Find(run_id));
  // An existing name is replaced only when asked, and only when it holds a PEFT adapter
  // folder (an upload or an export): a SaveState checkpoint (trainer_state.json) stays.
  if (PathExists(folder)) {
    if (!replace) {
      return absl::AlreadyExistsError(absl::StrCat("path: ", path, " exists; choose another name, or set replace to "
                                                   "replace an uploaded PEFT adapter"));
    }
    if (PathExists(folder + "/trainer_state.json") || !PathExists(folder + "/adapter_config.json")) {
      return absl::FailedPreconditionError(absl::StrCat(
          "path: ", path, " holds a SaveState checkpoint, not a PEFT adapter folder; replace applies only to "
          "uploaded or exported adapters"));
    }
  }
  TrainerOptions o;
  o.lora = run->adapter().lora_config();
  o.grad = options_.grad;
  LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> scratch, Trainer::Create(base_, o));
  absl::Status stored = WriteFolderAtomically(folder, [&](const std::string& tmp) -> absl::Status {
    LORASTEP_RETURN_IF_ERROR(WriteStringToFile(tmp + "/adapter_config.json", adapter_config));
    LORASTEP_RETURN_IF_ERROR(WriteStringToFile(tmp + "/adapter_model.safetensors", adapter_model));
    // Loaded as init_from would load it: names, shapes, rank, alpha, targets, finite values.
    return scratch->ImportAdapter(tmp);
  });
  LORASTEP_RETURN_IF_ERROR(AsReference(stored, folder, path));
  return PathResult{"", run->learner_version()};
}

absl::StatusOr<const StateStore*> WorkerCore::Store() const {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError("this server has no state store (it was started with --allow_plain_paths)");
  }
  return store_.get();
}

absl::StatusOr<std::string> WorkerCore::ResolvePath(const std::string& run_id, const std::string& path,
                                                    bool write) const {
  LORASTEP_ASSIGN_OR_RETURN(std::string folder, ResolveRequestPath(store_.get(), path, "path"));
  if (store_ != nullptr && !write && !PathExists(folder)) {
    return absl::NotFoundError(absl::StrCat("path: ", path, ": nothing is saved under that reference"));
  }
  if (store_ != nullptr && write) {
    const std::string own = absl::StrCat(kStateRefScheme, run_id, "/");
    if (path.compare(0, own.size(), own) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("path: a run writes under its own references (", own, "<name>)"));
    }
  }
  return folder;
}

absl::StatusOr<std::vector<StoredFolder>> WorkerCore::ListCheckpoints(const std::string& run_id) const {
  LORASTEP_ASSIGN_OR_RETURN(const StateStore* store, Store());
  return store->List(run_id);
}

absl::Status WorkerCore::DeleteCheckpoint(const std::string& run_id, const std::string& name) {
  LORASTEP_ASSIGN_OR_RETURN(const StateStore* store, Store());
  // A background write there finishes first: it would otherwise land after the delete.
  writer_.Await(ResolveRequestPath(store, absl::StrCat(kStateRefScheme, run_id, "/", name), "name").value_or(""));
  return store->Delete(run_id, name);
}

}  // namespace lorastep
