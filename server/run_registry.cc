#include "server/run_registry.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/io/state_store.h"

namespace lorastep {

RunRegistry::RunRegistry(RunLimits limits, PrometheusRegistry* metrics) : limits_(limits), metrics_(metrics) {
  if (metrics_ != nullptr) {
    metrics_->Declare("lorastep_runs", PrometheusRegistry::Type::kGauge, "runs that exist on this coordinator");
  }
}

absl::StatusOr<RunRef> RunRegistry::Find(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  return it->second;
}

absl::Status RunRegistry::CheckAccess(const std::string& run_id, const Caller& caller) const {
  if (caller.admin) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(run_id);
  // The owner is set at creation and never changes: read without the run's view lock.
  if (it == runs_.end() || it->second->run.owner() != caller.owner) {
    return absl::NotFoundError(absl::StrCat("run_id: no run '", run_id, "'"));
  }
  return absl::OkStatus();
}

std::vector<RunRef> RunRegistry::All() const {
  return Where([](const RunState&) { return true; });
}

std::vector<RunRef> RunRegistry::Where(const std::function<bool(const RunState&)>& pick) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RunRef> out;
  for (const auto& [id, run] : runs_) {
    if (pick(*run)) out.push_back(run);
  }
  return out;
}

size_t RunRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_.size();
}

bool RunRegistry::Contains(const std::string& run_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_.count(run_id) > 0;
}

absl::StatusOr<RunRegistry::Reservation> RunRegistry::Reserve(const std::string& request_id,
                                                              const std::string& fingerprint, const std::string& owner,
                                                              const std::string& requested_id,
                                                              const std::string& id_prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  Reservation r;
  auto prior = create_requests_.find(request_id);
  if (prior != create_requests_.end()) {  // retried CreateRun: the run it made
    const RunRef& made = runs_.at(prior->second.first);
    if (made->run.owner() != owner) {
      return absl::InvalidArgumentError("request_id: already used; a new run needs a new request_id");
    }
    if (prior->second.second != fingerprint) {
      return absl::InvalidArgumentError(absl::StrCat("request_id: '", request_id, "' already created run '",
                                                     prior->second.first,
                                                     "' from a different CreateRun request; a new run needs a new request_id"));
    }
    r.existing = made;
    return r;
  }
  if (creating_requests_.count(request_id)) {
    return absl::UnavailableError("request_id: this CreateRun is still in progress; retry");
  }
  if (runs_.size() + creating_ids_.size() >= limits_.max_runs) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_runs: ", runs_.size(), " runs exist, the limit of this coordinator; DeleteRun one first"));
  }
  if (!owner.empty()) {  // one key cannot take every slot of --max_runs from the others
    size_t held = creating_owners_.count(owner);
    for (const auto& [id, run] : runs_) held += run->run.owner() == owner ? 1 : 0;
    if (held >= limits_.max_runs_per_owner) {
      return absl::ResourceExhaustedError(absl::StrCat("max_runs_per_key: '", owner, "' holds ", held,
                                                       " runs, the limit per API key; DeleteRun one first"));
    }
  }
  std::string run_id = id_prefix + requested_id;
  if (requested_id.empty()) {
    do {
      run_id = absl::StrCat(id_prefix, "run-", next_run_number_++);
    } while (runs_.count(run_id) || creating_ids_.count(run_id));
  } else if (absl::Status named = ValidateStoreName(requested_id, "run_id"); !named.ok()) {
    return named;  // run ids name state-store folders: the same rules
  } else if (run_id.size() > kMaxStoreNameBytes) {  // the owner's prefix counts too
    return absl::InvalidArgumentError(
        absl::StrCat("run_id: at most ", kMaxStoreNameBytes - id_prefix.size(), " bytes with API keys"));
  } else if (runs_.count(run_id) || creating_ids_.count(run_id)) {
    return absl::AlreadyExistsError(absl::StrCat("run_id: '", requested_id, "' exists"));
  }
  r.run_id = run_id;
  r.placement = runs_.size() + creating_ids_.size();
  creating_ids_.insert(run_id);
  creating_requests_.insert(request_id);
  if (!owner.empty()) creating_owners_.insert(owner);
  return r;
}

void RunRegistry::Release(const Reservation& r, const std::string& request_id, const std::string& owner) {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseLocked(r, request_id, owner);
}

void RunRegistry::Commit(const Reservation& r, const std::string& request_id, const std::string& owner,
                         const std::string& fingerprint, RunRef run) {
  std::lock_guard<std::mutex> lock(mu_);  // one step: the id is never free in between
  ReleaseLocked(r, request_id, owner);
  InsertLocked(std::move(run), request_id, fingerprint);
}

void RunRegistry::Insert(RunRef run, const std::string& request_id, const std::string& fingerprint) {
  std::lock_guard<std::mutex> lock(mu_);
  InsertLocked(std::move(run), request_id, fingerprint);
}

void RunRegistry::ReleaseLocked(const Reservation& r, const std::string& request_id, const std::string& owner) {
  creating_ids_.erase(r.run_id);
  creating_requests_.erase(request_id);
  if (!owner.empty()) creating_owners_.erase(creating_owners_.find(owner));
}

void RunRegistry::InsertLocked(RunRef run, const std::string& request_id, const std::string& fingerprint) {
  const std::string run_id = run->run.run_id();
  runs_[run_id] = std::move(run);
  if (!request_id.empty()) create_requests_[request_id] = {run_id, fingerprint};
  PublishCount();
}

bool RunRegistry::Remove(const RunState& run, bool forget_request) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string& run_id = run.run.run_id();
  auto it = runs_.find(run_id);
  if (it == runs_.end() || it->second.get() != &run) return false;
  runs_.erase(it);
  if (forget_request) {
    for (auto r = create_requests_.begin(); r != create_requests_.end();) {
      r = r->second.first == run_id ? create_requests_.erase(r) : std::next(r);
    }
  }
  PublishCount();
  return true;
}

void RunRegistry::PublishCount() {
  if (metrics_ != nullptr) metrics_->Set("lorastep_runs", {}, static_cast<double>(runs_.size()));
}

}  // namespace lorastep
