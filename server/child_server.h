// A lorastep server binary run as a child process on this machine: the coordinator's
// embedded local worker, or a coordinator started by tests and tools. Stops it on
// destruction: SIGTERM, then SIGKILL after a grace period.
#ifndef LORASTEP_SERVER_CHILD_SERVER_H_
#define LORASTEP_SERVER_CHILD_SERVER_H_

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace lorastep {

class ChildServer {
 public:
  // Runs `binary` with `args` plus --port 0 --port_file; waits until it reports its port.
  // Both server binaries take those two flags. `call_pipe`: the child (a worker) also gets
  // one end of a socket pair as its --coordinator_pipe_fd (rpc/call_pipe.h); TakePipeFd()
  // hands over the other.
  static absl::StatusOr<ChildServer> Start(const std::string& binary,
                                                  const std::vector<std::string>& args,
                                                  int timeout_seconds, bool call_pipe = false);
  // Starts every child at once, then waits until all have reported their ports (ranks of a
  // mesh rendezvous before serving). If any fails, all are killed.
  static absl::StatusOr<std::vector<ChildServer>> StartAll(
      const std::string& binary, const std::vector<std::vector<std::string>>& args_per_child,
      int timeout_seconds, bool call_pipe = false);
  ChildServer(ChildServer&& other) noexcept;
  // Stops (and reaps) the child this one held, then takes `other`'s.
  ChildServer& operator=(ChildServer&& other) noexcept;
  ~ChildServer();

  std::string address() const;
  pid_t pid() const { return pid_; }
  // This side of the child's call pipe, to the caller's keeping (-1: none, or taken).
  int TakePipeFd() { return std::exchange(pipe_fd_, -1); }
  // SIGTERM, then SIGKILL after 10 s. True when it exited on SIGTERM within that time.
  bool Stop();

 private:
  ChildServer(pid_t pid, int port, int pipe_fd) : pid_(pid), port_(port), pipe_fd_(pipe_fd) {}
  pid_t pid_ = -1;
  int port_ = 0;
  int pipe_fd_ = -1;
};

// A TCP port that is free on 127.0.0.1 right now (for a rendezvous the children bind).
int FreeLocalPort();

// A folder only this user can enter (mode 0700, under $TMPDIR, else /tmp), for the
// rendezvous files of a local mesh: its ranks meet at a c10d FileStore there, which needs no
// listening socket, so no other user of the machine and nothing off it can reach the store.
absl::StatusOr<std::string> MakePrivateDirectory(const std::string& name_prefix);

// The worker binary next to `argv0` (CMake layout) or in ../worker/ (Bazel layout).
std::string FindWorkerBinary(const std::string& argv0);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_CHILD_SERVER_H_
