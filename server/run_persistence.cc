#include "server/run_persistence.h"

#include <algorithm>
#include <future>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "lib/io/state_store.h"
#include "lib/log.h"
#include "lib/status_macros.h"
#include "server/worker_requests.h"

namespace lorastep {
namespace {

// Where a journaled run's worker state is saved after its steps: autosave-<n>, a fresh name
// each time, so a background write never replaces the autosave a restart would need.
// ("autosave" alone: journals written before the names.) Reserved for the journal.
bool IsAutosaveName(absl::string_view name) {
  if (name == "autosave") return true;
  if (!absl::ConsumePrefix(&name, "autosave-") || name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}
// The number of autosave-<n> (0 for "autosave" or another name).
int64_t AutosaveNumber(absl::string_view name) {
  int64_t n = 0;
  if (!IsAutosaveName(name) || !absl::ConsumePrefix(&name, "autosave-") || !absl::SimpleAtoi(name, &n)) return 0;
  return n;
}

}  // namespace

RunPersistence::RunPersistence(PersistenceOptions options, RunRegistry* runs, WorkerPool* pool, MeshExecutor* mesh)
    : options_(std::move(options)), runs_(runs), pool_(pool), mesh_(mesh) {
  if (options_.metrics != nullptr) {
    options_.metrics->Declare("lorastep_autosave_failures_total", PrometheusRegistry::Type::kCounter,
                              "background autosaves that were not written (a restart resumes from the one before)");
  }
}

RunPersistence::~RunPersistence() { Stop(); }

void RunPersistence::Start() {
  if (journaled() && options_.autosave_when_idle.count() > 0) idle_saver_ = std::thread([this] { IdleAutosaveLoop(); });
}

void RunPersistence::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (idle_saver_.joinable()) idle_saver_.join();
}

absl::Status RunPersistence::JournalCreate(const v1::Run& run, const v1::CreateRunRequest& req,
                                           const std::string& fingerprint) {
  if (!journaled()) return absl::OkStatus();
  v1::JournalRun journaled;
  *journaled.mutable_run() = run;
  journaled.set_create_request_id(req.request_id());
  journaled.set_create_fingerprint(fingerprint);
  journaled.set_init_from(req.init_from());
  journaled.set_init_with_optimizer(req.init_with_optimizer());
  return options_.journal->AddRun(journaled);
}

void RunPersistence::JournalCreateFailed(const std::string& run_id) {
  if (!journaled()) return;
  if (absl::Status s = options_.journal->RemoveRun(run_id); !s.ok()) LORASTEP_LOG(Error) << "journal: " << s;
}

void RunPersistence::JournalCall(RunState& run, const std::string& method, const std::string& request_id,
                                 const std::string& response, bool with_step) {
  if (!journaled()) return;
  v1::JournalEntry entry;
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    *entry.mutable_run() = run.run;
    if (with_step && !run.history.empty()) *entry.mutable_step() = run.history.back();
  }
  // Outside the view lock: readers never wait for the disk. The call is applied on the
  // workers already: a failed write cannot undo it, so it is logged (the run then restarts
  // from its previous autosave).
  entry.set_request_id(request_id);
  entry.set_method(method);
  entry.set_fingerprint(run.current_fingerprint);
  entry.set_response(response);
  if (absl::Status s = options_.journal->Append(run.run.run_id(), entry, /*sync=*/false); !s.ok()) {
    LORASTEP_LOG(Error) << "journal: run " << run.run.run_id() << ": " << s;
  }
}

void RunPersistence::MaybeAutosave(RunState& run, bool force) {
  Autosave(run, force, options_.autosave_in_background).IgnoreError();  // logged there; the step stands
}

absl::Status RunPersistence::SaveDurably(RunState& run) { return Autosave(run, /*force=*/true, /*background=*/false); }

absl::Status RunPersistence::Autosave(RunState& run, bool force, bool background) {
  if (!journaled()) return absl::OkStatus();
  const int64_t version = run.run.learner_version();
  const int every = run.run.lora().rank() == 0 ? options_.autosave_every_full_steps : options_.autosave_every_steps;
  const auto started = std::chrono::steady_clock::now();
  std::string name;
  {
    // One background write per run at a time (memory holds one copy of the state). Spaced by
    // cost, a step during it is too soon anyway (the write is the cost); otherwise the step
    // waits for it, so every due step is saved where it happened and the disk sets the pace
    // only when it is slower than the steps. (Skipping the step's autosave and saving later
    // could not save a state with a ForwardBackward's gradients pending.)
    std::unique_lock<std::mutex> lock(run.autosave_mu);
    AutosaveState& a = run.autosave;
    const bool due =
        force || (every > 0 ? version % every == 0
                            : a.last_s < 0 ||  // spaced by cost: not too soon after the last one
                                  std::chrono::duration<double>(started - a.last_end).count() *
                                          options_.autosave_max_share >= a.last_s);
    if (!due || (a.in_flight && !force && every <= 0)) return absl::OkStatus();
    run.autosave_cv.wait(lock, [&] { return !run.autosave.in_flight; });
    name = absl::StrCat("autosave-", a.next++);
  }
  const std::string& run_id = run.run.run_id();
  auto saved = mesh_->FanOut<v1::WorkerPathResponse>(run.ranks, run.AllRanks(), [&](int, WorkerClient* w) {
    v1::WorkerPathRequest wreq = PathRequest(run_id, StateRef(run_id, name));
    wreq.set_background(background);
    mesh_->StampMesh(wreq.mutable_mesh());
    return w->SaveState(wreq);
  });
  if (!saved.ok()) {  // the step stands; a restart would resume from the previous autosave
    LORASTEP_LOG(Error) << "autosave of run " << run_id << " at learner_version " << version << ": " << saved.status();
    return saved.status();
  }
  run.step_since_autosave = false;
  // The marker goes where the state was taken, between this call's record and the next's;
  // a background one is pending until the confirmation journals it as durable (fsynced).
  v1::JournalEntry marker;
  marker.set_autosave_marker(true);
  marker.set_autosave_name(name);
  marker.set_autosave_pending(background);
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    *marker.mutable_run() = run.run;
  }
  if (absl::Status s = options_.journal->Append(run_id, marker, /*sync=*/!background); !s.ok()) {
    LORASTEP_LOG(Error) << "journal: run " << run_id << ": " << s;
    return s;
  }
  std::unique_lock<std::mutex> lock(run.autosave_mu);
  if (!background) {
    run.autosave.last_end = std::chrono::steady_clock::now();
    run.autosave.last_s = std::chrono::duration<double>(run.autosave.last_end - started).count();
    const std::string previous = RecordDurableAutosave(run, name, version);
    lock.unlock();
    RemoveAutosave(run, previous);
    return absl::OkStatus();
  }
  run.autosave.in_flight = true;
  ++autosaves_submitted_;
  // Rank 0 writes the (gathered) state; the others copied nothing to write.
  confirmations_.Submit([this, state = run.shared_from_this(), writer = run.ranks[0], id = run_id, name, version,
                         started] {
    absl::Status written = (*writer)->AwaitSaved(PathRequest(id, StateRef(id, name)));
    std::unique_lock<std::mutex> lock(state->autosave_mu);
    AutosaveState& a = state->autosave;
    a.last_end = std::chrono::steady_clock::now();
    a.last_s = std::chrono::duration<double>(a.last_end - started).count();
    std::string previous;
    if (!a.retired) {
      v1::JournalEntry done;
      done.set_autosave_done(name);
      if (written.ok()) written = options_.journal->Append(id, done, /*sync=*/true);
      if (written.ok()) {
        previous = RecordDurableAutosave(*state, name, version);
      } else {  // a restart would resume from the previous autosave
        LORASTEP_LOG(Error) << "autosave " << name << " of run " << id << ": " << written;
        if (options_.metrics != nullptr) options_.metrics->Add("lorastep_autosave_failures_total", {{"run", id}});
      }
    }
    a.in_flight = false;
    state->autosave_cv.notify_all();
    lock.unlock();
    // Not under autosave_mu: removing a large autosave takes long enough that the next
    // step's autosave would wait for it. The journal names `name` now: a restore never needs
    // `previous` again.
    RemoveAutosave(*state, previous);
  });
  return absl::OkStatus();
}

std::string RunPersistence::RecordDurableAutosave(RunState& run, const std::string& name, int64_t version) {
  {
    std::lock_guard<std::mutex> view(run.view_mu);
    run.run.set_autosaved_learner_version(version);
  }
  const std::string previous = std::exchange(run.autosave.durable, name);
  return previous == name ? "" : previous;
}

void RunPersistence::RemoveAutosave(RunState& run, const std::string& name) {
  if (name.empty()) return;
  v1::DeleteCheckpointRequest del;  // an autosave a restart no longer needs (best effort)
  del.set_run_id(run.run.run_id());
  del.set_name(name);
  if (absl::Status s = (*run.ranks[0])->DeleteCheckpoint(del); !s.ok() && !absl::IsNotFound(s)) {
    LORASTEP_LOG(Warning) << "run " << run.run.run_id() << ": removing the autosave " << name << ": " << s;
  }
}

void RunPersistence::DeleteAutosaves(RunState& run, const std::string& keep) {
  v1::ListCheckpointsRequest list;
  list.set_run_id(run.run.run_id());
  auto listed = (*run.ranks[0])->ListCheckpoints(list);
  if (!listed.ok()) return;  // best effort: a worker without a store, or down
  for (const auto& c : listed->checkpoints()) {
    if (IsAutosaveName(c.name()) && c.name() != keep) RemoveAutosave(run, c.name());
  }
}

absl::Status RunPersistence::Forget(RunState& run) {
  if (!journaled()) return absl::OkStatus();
  {
    // A background autosave still being written is awaited (for a while) so it is removed
    // with the others rather than landing after them.
    std::unique_lock<std::mutex> lock(run.autosave_mu);
    run.autosave_cv.wait_for(lock, std::chrono::seconds(60), [&] { return !run.autosave.in_flight; });
    run.autosave.retired = true;
  }
  if (!run.OnDownWorker()) DeleteAutosaves(run, "");  // of no use any more (best effort)
  return options_.journal->RemoveRun(run.run.run_id());
}

bool RunPersistence::WaitForAutosaves(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {  // until no autosave started after the barrier (a step's, racing the shutdown)
    const int64_t submitted = autosaves_submitted_.load();
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> finished = done->get_future();
    confirmations_.Submit([done] { done->set_value(); });  // after every confirmation queued so far
    if (finished.wait_until(deadline) != std::future_status::ready) return false;
    if (autosaves_submitted_.load() == submitted) return true;
  }
}

absl::Status RunPersistence::CheckNotAutosaveName(const std::string& run_id, const std::string& name,
                                                  const char* field) const {
  if (!journaled() || !IsAutosaveName(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", StateRef(run_id, name),
                                                 " is a name the journal keeps for the run's autosaves; use another"));
}

absl::Status RunPersistence::CheckNotAutosavePath(const std::string& run_id, const std::string& path,
                                                  const char* field) const {
  absl::string_view rest = path;  // the <name> of lorastep://<run_id>/<name>
  if (!absl::ConsumePrefix(&rest, kStateRefScheme) || !absl::ConsumePrefix(&rest, run_id) ||
      !absl::ConsumePrefix(&rest, "/")) {
    return absl::OkStatus();
  }
  return CheckNotAutosaveName(run_id, std::string(rest), field);
}

void RunPersistence::IdleAutosaveLoop() {
  const auto idle = options_.autosave_when_idle;
  const auto tick = std::max(std::chrono::milliseconds(100), std::min(idle / 4, std::chrono::milliseconds(1000)));
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_cv_.wait_for(lock, tick, [&] { return stopping_; })) {
    lock.unlock();
    for (const RunRef& run : runs_->All()) {
      // A run with a call in flight is not idle: its own call saves it if due.
      std::unique_lock<std::mutex> run_lock(run->mu, std::try_to_lock);
      if (!run_lock.owns_lock() || !run->step_since_autosave ||
          std::chrono::steady_clock::now() - run->last_change < idle) {
        continue;
      }
      // Gradients of a pending ForwardBackward are not in an autosave, and its record would
      // sit before the marker: such a run waits for its OptimStep. A run on a down worker
      // comes back from the autosave it has.
      if (run->run.pending_forward_backward() > 0 || !run->run.diverged().empty() || run->OnDownWorker()) continue;
      {
        std::lock_guard<std::mutex> autosave_lock(run->autosave_mu);
        if (run->autosave.retired || run->autosave.in_flight) continue;
      }
      run->last_change = std::chrono::steady_clock::now();  // one that fails is tried an idle period later
      MaybeAutosave(*run, /*force=*/true);
    }
    lock.lock();
  }
}

absl::StatusOr<int> RunPersistence::RestoreRuns() {
  if (!journaled()) return 0;
  std::vector<absl::Status> skipped;
  LORASTEP_ASSIGN_OR_RETURN(std::vector<JournaledRun> journaled, options_.journal->Recover(&skipped));
  for (const absl::Status& s : skipped) LORASTEP_LOG(Error) << "journal: a run was not restored: " << s;
  int restored = 0;
  for (JournaledRun& j : journaled) {
    if (absl::Status s = RestoreRun(j, nullptr); !s.ok()) {
      LORASTEP_LOG(Error) << "run " << j.created.run().run_id() << " was not restored (it stays in the journal): " << s;
      continue;
    }
    ++restored;
    LORASTEP_LOG(Info) << "run " << j.run.run_id() << " restored at learner_version " << j.run.learner_version()
                       << ", next_sequence_id " << j.run.next_sequence_id()
                       << (j.autosaved ? " (from its autosave)" : " (as created: no step was autosaved)");
  }
  return restored;
}

void RunPersistence::WorkerRestarted(const PooledWorker* dead, const WorkerRef& onto) {
  RestoreOrphans(runs_->Where([&](const RunState& r) { return r.ranks.size() == 1 && r.ranks[0].get() == dead; }),
                 onto);
}

void RunPersistence::MeshBack(bool rejoined) {
  auto orphans = runs_->Where([](const RunState& r) { return r.OnDownWorker(); });
  LORASTEP_LOG(Info) << "lorastep_coordinator: " << orphans.size() << " run(s) with a replaced rank to restore";
  RestoreOrphans(orphans, nullptr);
  if (rejoined) RestoreJournaledRuns(nullptr);
}

void RunPersistence::Reattach(const WorkerRef& joined) {
  // The runs of a dead predecessor at this address, then journaled runs not restored yet
  // (a restarted coordinator has no worker until one registers).
  const std::string address = (*joined)->address();
  RestoreOrphans(runs_->Where([&](const RunState& r) {
    return r.ranks.size() == 1 && r.ranks[0] != joined && r.ranks[0]->down && (*r.ranks[0])->address() == address;
  }),
                 joined);
  RestoreJournaledRuns(joined);
}

void RunPersistence::RestoreJournaledRuns(const WorkerRef& onto) {
  if (!journaled()) return;
  const std::string where = onto != nullptr ? (*onto)->address() : pool_->layout().ToString();
  std::vector<absl::Status> skipped;
  auto journaled = options_.journal->Recover(&skipped);
  if (!journaled.ok()) {
    LORASTEP_LOG(Error) << "journal: " << journaled.status();
    return;
  }
  for (const JournaledRun& j : *journaled) {
    if (runs_->Contains(j.created.run().run_id())) continue;
    // A run whose autosave lives in another worker's state store fails here and waits for
    // that worker to register.
    if (absl::Status s = RestoreRun(j, onto); !s.ok()) {
      LORASTEP_LOG(Warning) << "run " << j.created.run().run_id() << " not restored onto " << where << ": " << s;
    } else {
      LORASTEP_LOG(Info) << "run " << j.run.run_id() << " restored onto " << where << " at learner_version "
                         << j.run.learner_version();
    }
  }
}

void RunPersistence::RestoreOrphans(const std::vector<RunRef>& orphans, const WorkerRef& onto) {
  if (!journaled()) {  // nothing to restore from: the runs stay on the dead worker
    for (const RunRef& old : orphans) {
      LORASTEP_LOG(Warning) << "run " << old->run.run_id() << " is lost with its worker (no journal)";
    }
    return;
  }
  for (const RunRef& old : orphans) {
    std::lock_guard<std::mutex> run_lock(old->mu);  // after the call that found the worker dead
    const std::string run_id = old->run.run_id();
    const absl::Status restored = RestoreOne(*old, onto);
    if (absl::IsNotFound(restored)) continue;  // deleted meanwhile
    if (!restored.ok()) {
      LORASTEP_LOG(Error) << "run " << run_id << " was not restored after its worker died: " << restored;
    } else {
      LORASTEP_LOG(Info) << "run " << run_id << " restored after its worker died";
    }
  }
}

absl::Status RunPersistence::RestoreOne(RunState& old, const WorkerRef& onto) {
  {
    // The journal is cut back to the last durable autosave by the restore below (Settle): a
    // confirmation of the old run's background autosave journals nothing after this.
    std::lock_guard<std::mutex> autosave_lock(old.autosave_mu);
    old.autosave.retired = true;
  }
  LORASTEP_ASSIGN_OR_RETURN(JournaledRun journaled, options_.journal->RecoverRun(old.run.run_id()));
  RunRef kept = old.shared_from_this();
  if (!runs_->Remove(old, /*forget_request=*/false)) return absl::NotFoundError("run_id: deleted meanwhile");
  absl::Status restored = RestoreRun(journaled, onto);
  if (!restored.ok()) runs_->Insert(kept, "", "");  // keep the old run visible rather than lose it
  return restored;
}

absl::StatusOr<v1::Run> RunPersistence::RestoreInPlace(RunState& run) {
  if (!journaled()) return absl::FailedPreconditionError("no journal: the run cannot be restored from an autosave");
  {
    // A background autosave of the last consistent state is let finish, so it counts.
    std::unique_lock<std::mutex> lock(run.autosave_mu);
    run.autosave_cv.wait_for(lock, std::chrono::seconds(60), [&] { return !run.autosave.in_flight; });
  }
  const std::string run_id = run.run.run_id();
  LORASTEP_RETURN_IF_ERROR(RestoreOne(run, run.ranks.size() == 1 ? run.ranks[0] : nullptr));
  LORASTEP_ASSIGN_OR_RETURN(RunRef restored, runs_->Find(run_id));
  std::lock_guard<std::mutex> view(restored->view_mu);
  LORASTEP_LOG(Warning) << "run " << run_id << " restored from its autosave at learner_version "
                        << restored->run.learner_version() << " after a rank failed past the commit vote";
  return restored->run;
}

absl::Status RunPersistence::RestoreRun(const JournaledRun& j, const WorkerRef& onto) {
  const std::string run_id = j.created.run().run_id();
  if (runs_->Contains(run_id)) return absl::AlreadyExistsError(absl::StrCat("run_id: '", run_id, "' exists"));
  auto state = std::make_shared<RunState>(options_.record_limits);
  if (onto != nullptr && !onto->down) {
    state->ranks = {onto};
  } else {
    LORASTEP_ASSIGN_OR_RETURN(state->ranks, pool_->Place(runs_->size()));
  }
  state->run = j.created.run();
  v1::WorkerCreateRunRequest create;
  create.set_run_id(run_id);
  *create.mutable_lora() = j.created.run().lora();
  create.set_seed(j.created.run().seed());
  if (!j.autosaved) {  // no step was saved: the run as it was created
    create.set_init_from(j.created.init_from());
    create.set_init_with_optimizer(j.created.init_with_optimizer());
  }
  auto create_on_ranks = [&] {
    return mesh_->FanOut<v1::WorkerCreateRunResponse>(state->ranks, state->AllRanks(), [&](int, WorkerClient* w) {
      v1::WorkerCreateRunRequest call = create;
      mesh_->StampMesh(call.mutable_mesh());
      return w->CreateRun(call);
    });
  };
  auto delete_on_ranks = [&] {  // best effort: what a failed restore left on the workers
    v1::WorkerDeleteRunRequest del;
    del.set_run_id(run_id);
    mesh_->FanOut<bool>(state->ranks, state->AllRanks(), [&](int, WorkerClient* w) -> absl::StatusOr<bool> {
      LORASTEP_RETURN_IF_ERROR(w->DeleteRun(del));
      return true;
    }).IgnoreError();
  };
  auto created = create_on_ranks();
  if (absl::IsAlreadyExists(created.status())) {  // workers that outlived the coordinator
    delete_on_ranks();
    created = create_on_ranks();
  }
  LORASTEP_RETURN_IF_ERROR(created.status());
  int64_t version = (*created)[0].learner_version();
  if (j.autosaved) {
    // Unique per restore: a worker answers a request_id it has seen from its record.
    const std::string request_id = absl::StrCat("restore-", run_id, "-", NowUnixMs(), "-", ++restore_count_);
    auto loaded = mesh_->FanOut<v1::WorkerPathResponse>(state->ranks, state->AllRanks(), [&](int, WorkerClient* w) {
      v1::WorkerPathRequest wreq = PathRequest(run_id, StateRef(run_id, j.autosave_name));
      wreq.mutable_mesh()->set_request_id(request_id);
      wreq.mutable_mesh()->set_expected_learner_version(-1);
      mesh_->StampMesh(wreq.mutable_mesh());
      return w->LoadState(wreq);
    });
    if (!loaded.ok() || (*loaded)[0].learner_version() != j.run.learner_version()) {
      delete_on_ranks();
      if (absl::IsNotFound(loaded.status()) && j.newer_pending != nullptr) {
        // The journal's tail was torn, and with it, it seems, the record that made the newer
        // autosave durable (the older one is removed once a newer one is): restore from it.
        LORASTEP_LOG(Warning) << "run " << run_id << ": " << StateRef(run_id, j.autosave_name)
                              << " is gone; restoring from " << StateRef(run_id, j.newer_pending->autosave_name)
                              << ", whose durable record the torn journal tail held";
        return RestoreRun(*j.newer_pending, onto);
      }
      if (!loaded.ok()) return loaded.status();
      return absl::DataLossError(absl::StrCat(StateRef(run_id, j.autosave_name), " holds learner_version ",
                                              (*loaded)[0].learner_version(), ", the journal ",
                                              j.run.learner_version()));
    }
    version = (*loaded)[0].learner_version();
  }
  // The journal says from here on exactly what was restored, before the run takes a call.
  if (absl::Status settled = options_.journal->Settle(j); !settled.ok()) {
    delete_on_ranks();
    return settled;
  }
  state->run = j.run;
  state->run.set_learner_version(version);
  state->run.set_pending_forward_backward(0);
  // Autosaves that never became durable (or that a crash kept from being removed) go.
  state->autosave.durable = j.autosave_name;
  state->autosave.next = AutosaveNumber(j.autosave_name) + 1;
  if (j.autosaved) {
    state->run.set_autosaved_learner_version(version);
  } else {
    state->run.clear_autosaved_learner_version();
  }
  DeleteAutosaves(*state, j.autosave_name);
  state->restored_note = absl::StrCat(" (the run was restored after a restart at learner_version ", version,
                                      ", next_sequence_id ", j.run.next_sequence_id(),
                                      "; calls after its last autosave were dropped)");
  for (const v1::JournalEntry& e : j.entries) {
    if (e.autosave_marker()) continue;
    state->records.Keep(e.request_id(), e.method(), e.response(), e.fingerprint());
    if (e.has_step()) {
      state->history.push_back(e.step());
      state->next_step = e.step().step() + 1;
      while (state->history.size() > options_.max_step_history) state->history.pop_front();
    }
  }
  runs_->Insert(state, j.created.create_request_id(), j.created.create_fingerprint());
  if (options_.metrics != nullptr) {
    options_.metrics->Set("lorastep_learner_version", {{"run", run_id}}, static_cast<double>(version));
  }
  return absl::OkStatus();
}

}  // namespace lorastep
