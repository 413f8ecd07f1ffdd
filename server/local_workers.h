// The worker processes a coordinator starts on its own machine: one per rank of its mesh
// (rank r on cuda:r, or a CPU process each), their flags, and their restarts: one worker again
// at a fresh address, or a whole mesh at a fresh rendezvous (a process group takes no new
// member alone). gRPC-free: the coordinator connects to the addresses.
#ifndef LORASTEP_SERVER_LOCAL_WORKERS_H_
#define LORASTEP_SERVER_LOCAL_WORKERS_H_

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/child_server.h"

namespace lorastep {

// A started worker: where it serves, and this side of its call pipe (-1: none).
struct LocalWorker {
  std::string address;
  int pipe_fd = -1;
};

class LocalWorkers {
 public:
  // Starts `per_rank.size()` workers of `binary` together, rank r with per_rank[r]'s flags;
  // a mesh (more than one rank) meets at a c10d FileStore in a folder only this user can
  // enter (nothing listens for the rendezvous), passed as --rendezvous.
  static absl::StatusOr<std::unique_ptr<LocalWorkers>> Start(std::string binary,
                                                             std::vector<std::vector<std::string>> per_rank,
                                                             int start_timeout_s, bool call_pipe);
  ~LocalWorkers();  // stops them (SIGTERM, then SIGKILL) and removes the rendezvous folder

  // The workers as started: their addresses and call pipes, by rank.
  std::vector<LocalWorker> TakeStarted();
  // The one worker that served at `address`, started again with its flags (NOT_FOUND: none did).
  absl::StatusOr<LocalWorker> RestartOne(const std::string& address);
  // Every rank stopped and started again, at a fresh rendezvous.
  absl::StatusOr<std::vector<LocalWorker>> RestartAll();
  // Stops every worker now (the coordinator's shutdown).
  void StopAll();

 private:
  LocalWorkers(std::string binary, std::vector<std::vector<std::string>> per_rank, int start_timeout_s, bool call_pipe)
      : binary_(std::move(binary)), per_rank_(std::move(per_rank)), start_timeout_s_(start_timeout_s),
        call_pipe_(call_pipe) {}
  absl::Status StartEvery();  // under mu_: every rank at a fresh rendezvous
  std::vector<LocalWorker> Started();  // under mu_

  const std::string binary_;
  std::vector<std::vector<std::string>> per_rank_;  // each rank's flags, --rendezvous last on a mesh
  const int start_timeout_s_;
  const bool call_pipe_;
  std::string rendezvous_dir_;  // a mesh's private folder; empty at world size 1
  int rendezvous_count_ = 0;
  std::mutex mu_;  // the children: restarts come from the coordinator's upkeep threads
  std::vector<ChildServer> children_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_LOCAL_WORKERS_H_
