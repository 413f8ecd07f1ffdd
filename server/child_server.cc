#include "server/child_server.h"

#include <algorithm>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"
#include "lib/parent_death.h"

extern char** environ;

namespace lorastep {
namespace {

// The call pipe's descriptor number in the child (the first after stdin, stdout, stderr).
constexpr int kChildPipeFd = 3;

}  // namespace

absl::StatusOr<ChildServer> ChildServer::Start(const std::string& binary,
                                               const std::vector<std::string>& args,
                                               int timeout_seconds, bool call_pipe) {
  LORASTEP_ASSIGN_OR_RETURN(std::vector<ChildServer> one, StartAll(binary, {args}, timeout_seconds, call_pipe));
  return std::move(one[0]);
}

absl::StatusOr<std::vector<ChildServer>> ChildServer::StartAll(
    const std::string& binary, const std::vector<std::vector<std::string>>& args_per_child,
    int timeout_seconds, bool call_pipe) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("server binary not found: ", binary));
  }
  char dir_template[] = "/tmp/lorastep-child-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a temp folder");
  std::vector<pid_t> pids;
  std::vector<int> pipe_fds;  // this side of each child's call pipe (-1: none)
  std::vector<std::string> port_files;
  auto kill_all = [&] {
    for (pid_t pid : pids) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    for (int fd : pipe_fds) {
      if (fd >= 0) close(fd);
    }
    RemoveAll(dir_template).IgnoreError();
  };
  // Every child starts before any is waited for: ranks of a mesh meet at a rendezvous
  // before they serve.
  for (size_t i = 0; i < args_per_child.size(); ++i) {
    port_files.push_back(absl::StrCat(dir_template, "/port", i));
    std::vector<std::string> argv_s = {binary};
    argv_s.insert(argv_s.end(), args_per_child[i].begin(), args_per_child[i].end());
    // A child given --port keeps it (a worker restarted at its old address); else any free one.
    const auto& a = args_per_child[i];
    if (std::find(a.begin(), a.end(), "--port") == a.end()) argv_s.insert(argv_s.end(), {"--port", "0"});
    argv_s.insert(argv_s.end(), {"--port_file", port_files.back()});
    // The call pipe: a socket pair whose child end becomes the child's descriptor
    // kChildPipeFd, and nobody else's (both ends are close-on-exec here, so a child started
    // beside it does not inherit it).
    int pair[2] = {-1, -1};
    if (call_pipe) {
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        kill_all();
        return ErrnoError("socketpair for a child's call pipe", binary);
      }
      if (pair[1] == kChildPipeFd) {  // dup2 onto itself would keep close-on-exec
        const int moved = fcntl(pair[1], F_DUPFD_CLOEXEC, kChildPipeFd + 1);
        close(pair[1]);
        pair[1] = moved;
      }
      argv_s.insert(argv_s.end(), {"--coordinator_pipe_fd", std::to_string(kChildPipeFd)});
    }
    pipe_fds.push_back(pair[0]);
    // posix_spawn, not fork: no copy of this (large, threaded) process's page tables, and
    // nothing runs between the clone and the exec. The child arms its parent-death signal
    // itself (ExitWithSpawningParent), told who its parent is through the environment.
    std::vector<char*> argv;
    for (auto& arg : argv_s) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, kParentPidVariable, std::strlen(kParentPidVariable)) != 0) env_s.push_back(*e);
    }
    env_s.push_back(absl::StrCat(kParentPidVariable, "=", getpid()));
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    // The child must not inherit the coordinator's blocked shutdown signals.
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGPIPE}) sigaddset(&defaults, sig);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    if (call_pipe) posix_spawn_file_actions_adddup2(&files, pair[1], kChildPipeFd);
    pid_t pid = -1;
    const int spawned = posix_spawn(&pid, binary.c_str(), &files, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&files);
    posix_spawnattr_destroy(&attr);
    if (pair[1] >= 0) close(pair[1]);
    if (spawned != 0) {
      kill_all();
      return absl::InternalError(absl::StrCat("posix_spawn ", binary, ": ", std::strerror(spawned)));
    }
    pids.push_back(pid);
  }
  std::vector<int> ports(pids.size(), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    size_t ready = 0;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (ports[i] == 0) {
        auto text = ReadFileToString(port_files[i]);
        if (text.ok() && !text->empty()) ports[i] = std::atoi(text->c_str());
      }
      if (ports[i] != 0) {
        ++ready;
        continue;
      }
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        pids.erase(pids.begin() + i);
        kill_all();
        return absl::InternalError(absl::StrCat("child ", i, " exited during start-up (status ",
                                                status, "); see its stderr"));
      }
    }
    if (ready == pids.size()) {
      RemoveAll(dir_template).IgnoreError();
      std::vector<ChildServer> children;
      for (size_t i = 0; i < pids.size(); ++i) children.push_back(ChildServer(pids[i], ports[i], pipe_fds[i]));
      return children;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill_all();
  return absl::DeadlineExceededError(
      absl::StrCat("children did not report a port within ", timeout_seconds, " s"));
}

ChildServer::ChildServer(ChildServer&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), port_(other.port_), pipe_fd_(std::exchange(other.pipe_fd_, -1)) {}

ChildServer& ChildServer::operator=(ChildServer&& other) noexcept {
  if (this != &other) {
    Stop();
    pid_ = std::exchange(other.pid_, -1);
    port_ = other.port_;
    pipe_fd_ = std::exchange(other.pipe_fd_, -1);
  }
  return *this;
}

ChildServer::~ChildServer() { Stop(); }

std::string ChildServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

bool ChildServer::Stop() {
  if (pipe_fd_ >= 0) close(std::exchange(pipe_fd_, -1));
  if (pid_ <= 0) return true;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {  // up to 10 s to shut down cleanly
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  return false;
}

int FreeLocalPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

absl::StatusOr<std::string> MakePrivateDirectory(const std::string& name_prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/", name_prefix, "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return ErrnoError("cannot make a private folder", pattern);
  return pattern;  // mkdtemp makes it 0700
}

std::string FindWorkerBinary(const std::string& argv0) {
  const std::string dir = ParentPath(argv0);
  for (const std::string& candidate :
       {dir + "/lorastep_worker", dir + "/../worker/lorastep_worker"}) {
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return dir + "/lorastep_worker";
}

}  // namespace lorastep
