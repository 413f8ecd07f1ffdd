#include "server/local_workers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"

namespace lorastep {

absl::StatusOr<std::unique_ptr<LocalWorkers>> LocalWorkers::Start(std::string binary,
                                                                  std::vector<std::vector<std::string>> per_rank,
                                                                  int start_timeout_s, bool call_pipe) {
  std::unique_ptr<LocalWorkers> workers(
      new LocalWorkers(std::move(binary), std::move(per_rank), start_timeout_s, call_pipe));
  if (workers->per_rank_.size() > 1) {
    LORASTEP_ASSIGN_OR_RETURN(workers->rendezvous_dir_, MakePrivateDirectory("lorastep-rendezvous-"));
    for (auto& args : workers->per_rank_) args.insert(args.end(), {"--rendezvous", ""});
  }
  std::lock_guard<std::mutex> lock(workers->mu_);
  LORASTEP_RETURN_IF_ERROR(workers->StartEvery());
  return workers;
}

LocalWorkers::~LocalWorkers() { StopAll(); }

absl::Status LocalWorkers::StartEvery() {
  if (!rendezvous_dir_.empty()) {
    const std::string rendezvous = absl::StrCat("file://", rendezvous_dir_, "/store-", rendezvous_count_++);
    for (auto& args : per_rank_) args.back() = rendezvous;
  }
  LORASTEP_ASSIGN_OR_RETURN(children_, ChildServer::StartAll(binary_, per_rank_, start_timeout_s_, call_pipe_));
  return absl::OkStatus();
}

std::vector<LocalWorker> LocalWorkers::Started() {
  std::vector<LocalWorker> started;
  for (ChildServer& child : children_) started.push_back({child.address(), child.TakePipeFd()});
  return started;
}

std::vector<LocalWorker> LocalWorkers::TakeStarted() {
  std::lock_guard<std::mutex> lock(mu_);
  return Started();
}

absl::StatusOr<LocalWorker> LocalWorkers::RestartOne(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < children_.size(); ++i) {
    if (children_[i].address() != address) continue;
    LORASTEP_ASSIGN_OR_RETURN(ChildServer fresh, ChildServer::Start(binary_, per_rank_[i], start_timeout_s_, call_pipe_));
    children_[i] = std::move(fresh);
    return LocalWorker{children_[i].address(), children_[i].TakePipeFd()};
  }
  return absl::NotFoundError(absl::StrCat("no local worker at ", address));
}

absl::StatusOr<std::vector<LocalWorker>> LocalWorkers::RestartAll() {
  std::lock_guard<std::mutex> lock(mu_);
  children_.clear();  // stops and reaps the ranks still running
  LORASTEP_RETURN_IF_ERROR(StartEvery());
  return Started();
}

void LocalWorkers::StopAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (ChildServer& child : children_) child.Stop();
  if (!rendezvous_dir_.empty()) (void)RemoveAll(rendezvous_dir_);
}

}  // namespace lorastep
