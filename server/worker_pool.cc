#include "server/worker_pool.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/log.h"
#include "lib/status_macros.h"

namespace lorastep {

WorkerPool::WorkerPool(WorkerPoolOptions options) : options_(std::move(options)) {
  auto layout = ParallelLayout::Create(options_.mesh, options_.mesh.world());
  if (layout.ok()) layout_ = *layout;  // sizes were validated by the caller (main)
}

WorkerPool::~WorkerPool() { Stop(); }

void WorkerPool::Start(WorkerRecovery recovery) {
  recovery_ = std::move(recovery);
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
  }
  // With a journal the thread restarts dead workers and re-attaches registered ones (Add
  // queues them; a mesh once every rank is up). Without one it still starts a dead local
  // worker again: its runs' state is lost, but the service comes back for new runs.
  const bool restarts = on_mesh() ? static_cast<bool>(options_.restart_mesh) : static_cast<bool>(options_.restart_worker);
  if (restarts || options_.journaled) restarter_ = std::thread([this] { RestartLoop(); });
  if (options_.health_interval.count() > 0) health_watch_ = std::thread([this] { HealthWatchLoop(); });
}

void WorkerPool::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (restarter_.joinable()) restarter_.join();
  if (health_watch_.joinable()) health_watch_.join();
}

void WorkerPool::RestartLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || mesh_rejoined_ || !restart_queue_.empty() || !reattach_queue_.empty(); });
    if (stopping_) return;
    if (mesh_rejoined_) {
      mesh_rejoined_ = false;
      lock.unlock();
      // (A replaced rank has set regenerate_: the restores' calls form a new generation.)
      LORASTEP_LOG(Info) << "lorastep_coordinator: mesh " << layout_.ToString() << " is whole";
      recovery_.mesh_back(/*rejoined=*/true);
      lock.lock();
      continue;
    }
    if (!reattach_queue_.empty()) {
      WorkerRef joined = std::move(reattach_queue_.front());
      reattach_queue_.pop_front();
      lock.unlock();
      recovery_.reattached(joined);
      lock.lock();
      continue;
    }
    WorkerRef dead = std::move(restart_queue_.front());
    restart_queue_.pop_front();
    if (on_mesh()) restart_queue_.clear();  // one restart brings every rank back
    // A worker marked down while an earlier restart was replacing it (a call or health check
    // reached the old process as it was stopped) is gone already: restarting for it would
    // stop the fresh workers, and under load every restart queued the next one.
    if (dead != nullptr && std::find(workers_.begin(), workers_.end(), dead) == workers_.end()) continue;
    lock.unlock();
    if (on_mesh()) {
      RestartMesh();
    } else {
      RestartWorker(dead);
    }
    lock.lock();
  }
}

void WorkerPool::HealthWatchLoop() {
  std::map<const PooledWorker*, int> unanswered;  // consecutive UNAVAILABLE pings
  const auto timeout = std::chrono::seconds(5);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, options_.health_interval, [&] { return stopping_; })) {
    std::vector<WorkerRef> up;
    for (const auto& w : workers_) {
      if (w != nullptr && !w->down) up.push_back(w);
    }
    lock.unlock();
    std::map<const PooledWorker*, int> still;
    for (const WorkerRef& w : up) {
      // Only a process that is gone (the transport fails) counts; a busy or stopped one that
      // does not answer in time is left to the calls' deadlines.
      absl::Status alive = (*w)->Ping(timeout);
      if (!absl::IsUnavailable(alive)) continue;
      if ((still[w.get()] = unanswered[w.get()] + 1) >= 2) MarkDown(w.get(), alive);
    }
    unanswered = std::move(still);
    lock.lock();
  }
}

absl::Status WorkerPool::Add(std::unique_ptr<WorkerClient> client) {
  LORASTEP_ASSIGN_OR_RETURN(v1::WorkerInfo info, client->Info());
  auto worker = std::make_shared<PooledWorker>(std::move(client), info.instance_id());
  const std::string& address = (*worker)->address();
  std::lock_guard<std::mutex> lock(mu_);
  if (on_mesh()) {
    const ParallelSizes& m = options_.mesh;
    if (info.world_size() != m.world() || info.tp() != m.tp || info.pp() != m.pp || info.dp() != m.dp ||
        std::max(1, info.cp()) != m.cp) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", address, " is rank ", info.rank(), " of a tp",
                                                        info.tp(), " x pp", info.pp(), " x dp", info.dp(), " x cp",
                                                        std::max(1, info.cp()), " mesh, not of ", layout_.ToString()));
    }
    if (workers_.size() != static_cast<size_t>(m.world())) workers_.resize(m.world());
    const WorkerRef& held = workers_[info.rank()];
    if (held != nullptr && (*held)->address() == address && !held->down) {
      return absl::OkStatus();  // registered again (--register_every_s): kept as it is
    }
    if (held != nullptr && !held->down) {
      return absl::AlreadyExistsError(absl::StrCat("worker ", address, ": rank ", info.rank(), " is already registered"));
    }
  }
  // A journaled mesh restores its runs from autosaves that rank 0 writes and every rank
  // loads: the ranks must share one state store.
  const bool shares_store = on_mesh() && options_.journaled;
  if (shares_store && info.state_store_id().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "journal_dir: rank ", info.rank(), " at ", address,
        " has no state store; the ranks of a journaled mesh need one --state_dir they share"));
  }
  if (Registered() == 0) {
    model_path_ = info.model_path();
    vocab_size_ = info.vocab_size();
    store_id_ = info.state_store_id();
  } else if (info.model_path() != model_path_ || info.vocab_size() != vocab_size_) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", address, " serves ", info.model_path(), ", not ",
                                                      model_path_));
  } else if (shares_store && info.state_store_id() != store_id_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "journal_dir: rank ", info.rank(), " at ", address, " has a state store of its own (id ",
        info.state_store_id(), ", the other ranks' ", store_id_,
        "); the ranks of a journaled mesh need one --state_dir they share (rank 0 writes the autosaves "
        "every rank loads)"));
  }
  if (on_mesh()) {
    WorkerRef& slot = workers_[info.rank()];
    // A dead rank's worker stays alive (down) with the runs placed on it until they are restored.
    if (slot != nullptr) regenerate_ = true;
    slot = worker;
    rejoining_ranks_.erase(info.rank());
    if (rendezvous_.empty() && info.rank() == 0) rendezvous_ = info.rendezvous();  // a restarted coordinator
    if (options_.mesh_by_registration && restarter_.joinable() && Serving()) {
      mesh_rejoined_ = true;
      cv_.notify_all();
    }
  } else {
    // Registered workers announce themselves again and again (--register_every_s): the
    // process that is up at this address already is kept as it is. Another process there
    // (restarted before any call found the old one dead) replaces it.
    for (const WorkerRef& w : workers_) {
      if ((*w)->address() != address || w->down) continue;
      if (w->instance_id == info.instance_id()) return absl::OkStatus();
      LORASTEP_LOG(Warning) << "lorastep_coordinator: worker " << address
                            << " is a new process (the one known there is gone); it replaces it";
      w->down = true;
      break;
    }
    auto same = std::find_if(workers_.begin(), workers_.end(),
                             [&](const WorkerRef& w) { return (*w)->address() == address && w->down; });
    if (same != workers_.end()) {
      *same = worker;  // a restarted worker takes its dead predecessor's place
    } else {
      workers_.push_back(worker);
    }
    // With a journal, runs that belong at this address come back onto it; a restarted local
    // worker's runs are restored by RestartWorker instead.
    if (restarter_.joinable() && !RestartsDeadWorkers()) {
      reattach_queue_.push_back(worker);
      cv_.notify_all();
    }
  }
  PublishHealth();
  return absl::OkStatus();
}

void WorkerPool::RestartWorker(const WorkerRef& dead) {
  const std::string address = (*dead)->address();
  auto try_again = [&] {  // nothing (alive) answers there yet: back into the queue, after a pause
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::lock_guard<std::mutex> lock(mu_);
    restart_queue_.push_back(dead);
  };
  auto fresh = options_.restart_worker(address);
  if (!fresh.ok()) {
    if (absl::IsUnavailable(fresh.status())) return try_again();  // a listed worker not back yet
    LORASTEP_LOG(Error) << "lorastep_coordinator: restarting the worker at " << address << ": " << fresh.status();
    return;
  }
  const std::string replacement = (*fresh)->address();
  if (absl::Status added = Add(std::move(fresh).value()); !added.ok()) {
    LORASTEP_LOG(Error) << "lorastep_coordinator: the restarted worker " << replacement << ": " << added;
    if (absl::IsUnavailable(added)) try_again();  // e.g. the killed process's socket still accepted it
    return;
  }
  WorkerRef onto;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const WorkerRef& w : workers_) {
      if ((*w)->address() == replacement && !w->down) onto = w;
    }
  }
  if (onto == nullptr) return;  // died again already: its own restart is queued
  LORASTEP_LOG(Info) << "lorastep_coordinator: worker " << address << " restarted as " << replacement;
  recovery_.worker_restarted(dead.get(), onto);
}

void WorkerPool::RestartMesh() {
  auto try_again = [&] {  // a listed rank not back yet: ask again, after a pause
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::lock_guard<std::mutex> lock(mu_);
    restart_queue_.push_back(nullptr);
    cv_.notify_all();
  };
  auto fresh = options_.restart_mesh();
  if (!fresh.ok()) {
    if (absl::IsUnavailable(fresh.status())) return try_again();  // quietly: it may take a while
    LORASTEP_LOG(Error) << "lorastep_coordinator: restarting the mesh: " << fresh.status();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Ranks that lived on (a listed mesh) may have started forming the generation the
    // failure moved to, and left their sockets under its store keys: the next call moves
    // every rank to a generation no one has used. The old workers stay (down) with the runs
    // placed on them until those are restored onto the new ranks.
    regenerate_ = true;
    for (const WorkerRef& w : workers_) {
      if (w != nullptr) w->down = true;
    }
    workers_.clear();
  }
  for (auto& worker : *fresh) {
    const std::string address = worker->address();
    if (absl::Status added = Add(std::move(worker)); !added.ok()) {
      LORASTEP_LOG(Error) << "lorastep_coordinator: the restarted rank at " << address << ": " << added;
      // e.g. the dead process's connection was still open (gRPC shares it between channels
      // to one address): the next try replaces what this one added.
      if (absl::IsUnavailable(added)) try_again();
      return;
    }
  }
  LORASTEP_LOG(Info) << "lorastep_coordinator: mesh " << layout_.ToString() << " restarted";
  recovery_.mesh_back(/*rejoined=*/false);
}

absl::StatusOr<MeshAssignment> WorkerPool::AssignRank(const std::string& host) {
  if (host.empty()) return absl::InvalidArgumentError("host: required");
  if (!on_mesh()) return absl::FailedPreconditionError("coordinator: runs no mesh (--tp/--pp/--dp all 1); register as is");
  // Ranks in the order workers ask (skipping ranks that registered again with a restarted
  // coordinator), then the ranks of dead workers, each once until its new worker registers.
  const int world = options_.mesh.world();
  auto registered = [&](int r) { return static_cast<int>(workers_.size()) > r && workers_[r] != nullptr; };
  auto pick = [&]() -> int {  // under mu_; -1: every rank is taken
    while (next_join_rank_ < world && registered(next_join_rank_)) ++next_join_rank_;
    if (next_join_rank_ < world) return next_join_rank_++;
    for (int r = 0; r < world; ++r) {
      if (registered(r) && workers_[r]->down && !rejoining_ranks_.count(r)) {
        rejoining_ranks_.insert(r);
        LORASTEP_LOG(Info) << "lorastep_coordinator: rank " << r << " (down) handed to a worker on " << host;
        return r;
      }
    }
    return -1;
  };
  std::vector<WorkerRef> up;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (int rank = pick(); rank >= 0) return AssignmentOf(rank, host);
    for (int r = 0; r < world; ++r) {
      if (registered(r) && !workers_[r]->down) up.push_back(workers_[r]);
    }
  }
  // Every rank is taken, but the one asking may be the replacement of a rank that died
  // without any call noticing: a rank whose process is gone is marked down and handed out.
  for (const WorkerRef& w : up) {
    if (absl::Status alive = (*w)->Ping(std::chrono::seconds(5)); absl::IsUnavailable(alive)) MarkDown(w.get(), alive);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (int rank = pick(); rank >= 0) return AssignmentOf(rank, host);
  return absl::FailedPreconditionError(
      absl::StrCat("coordinator: all ", world, " ranks of ", layout_.ToString(), " are taken (and answering)"));
}

MeshAssignment WorkerPool::AssignmentOf(int rank, const std::string& host) {
  MeshAssignment a;
  a.rank = rank;
  a.sizes = options_.mesh;
  if (a.rank == 0) rendezvous_ = absl::StrCat(host, ":", options_.rendezvous_port);
  a.rendezvous = rendezvous_;
  return a;
}

absl::StatusOr<std::vector<WorkerRef>> WorkerPool::Place(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkerRef> up;
  for (const WorkerRef& w : workers_) {
    if (w != nullptr && !w->down) up.push_back(w);
  }
  if (on_mesh()) {  // every rank, in rank order
    if (up.size() < static_cast<size_t>(options_.mesh.world())) {
      return absl::UnavailableError("coordinator: a rank of the mesh is down; restart the mesh");
    }
    return up;
  }
  if (up.empty()) return absl::UnavailableError("coordinator: no worker is up; retry when one registers");
  return std::vector<WorkerRef>{up[index % up.size()]};
}

absl::Status WorkerPool::CheckCanCreate() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t registered = Registered();
  if (on_mesh() && !Serving()) {  // a rank of the current mesh is down
    return absl::UnavailableError("coordinator: a rank of the mesh is down; restart the mesh");
  }
  if (registered == 0 || (on_mesh() && registered < static_cast<size_t>(options_.mesh.world()))) {
    return absl::UnavailableError(absl::StrCat("coordinator: ", registered, " of ", on_mesh() ? options_.mesh.world() : 1,
                                               " workers registered yet; retry"));
  }
  return absl::OkStatus();
}

void WorkerPool::MarkDown(PooledWorker* worker, const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker->down) return;
  auto held = std::find_if(workers_.begin(), workers_.end(), [&](const WorkerRef& w) { return w.get() == worker; });
  worker->down = true;
  LORASTEP_LOG(Warning) << "lorastep_coordinator: worker " << (*worker)->address() << " is down (" << why.message()
                        << "); new runs skip it";
  PublishHealth();
  if (RestartsDeadWorkers() && held != workers_.end()) {  // one that was replaced already needs no restart
    restart_queue_.push_back(*held);
    cv_.notify_all();
  }
}

bool WorkerPool::RestartsDeadWorkers() const {
  return restarter_.joinable() &&
         (on_mesh() ? static_cast<bool>(options_.restart_mesh) : static_cast<bool>(options_.restart_worker));
}

std::string WorkerPool::WhatHappensToDownRuns() const {
  if (RestartsDeadWorkers() && !options_.journaled) {
    return "the worker is started again, but without a journal (a coordinator on --port 0 without --state_dir, "
           "or --nojournal) the run's state there is lost; DeleteRun it, or CreateRun with init_from a checkpoint";
  }
  if (RestartsDeadWorkers()) return "it is being restarted and the run restored from its autosave; retry";
  if (restarter_.joinable() && on_mesh()) {
    return "the run comes back from its autosave once a worker has registered in the dead rank's place; retry then";
  }
  if (restarter_.joinable()) {
    return "the run comes back from its autosave when a worker registers at that address again; retry then";
  }
  return "the run's state there is lost; LoadState a checkpoint into a new run (CreateRun with init_from)";
}

bool WorkerPool::TakeRegenerate() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(regenerate_, false);
}

std::string WorkerPool::rendezvous() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rendezvous_;
}

void WorkerPool::CancelInFlight() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const WorkerRef& w : workers_) {
    if (w != nullptr) (*w)->CancelInFlight();
  }
}

void WorkerPool::OnServingChange(std::function<void(bool)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  on_serving_ = std::move(callback);
  PublishHealth();
}

bool WorkerPool::Serving() const {
  const size_t up = std::count_if(workers_.begin(), workers_.end(), [](const WorkerRef& w) { return w != nullptr && !w->down; });
  return on_mesh() ? up == static_cast<size_t>(options_.mesh.world()) : up > 0;
}

void WorkerPool::PublishHealth() {
  if (on_serving_) on_serving_(Serving());
}

size_t WorkerPool::Registered() const {
  return std::count_if(workers_.begin(), workers_.end(), [](const WorkerRef& w) { return w != nullptr; });
}

size_t WorkerPool::num_registered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Registered();
}

std::string WorkerPool::model_path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_path_;
}

int64_t WorkerPool::vocab_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return vocab_size_;
}

}  // namespace lorastep
