#include "server/child_server.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/file_util.h"

namespace lorastep {

absl::StatusOr<ChildServer> ChildServer::Start(const std::string& binary,
                                                             const std::vector<std::string>& args,
                                                             int timeout_seconds) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("server binary not found: ", binary));
  }
  char dir_template[] = "/tmp/lorastep-child-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a temp folder");
  const std::string port_file = std::string(dir_template) + "/port";
  std::vector<std::string> argv_s = {binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  argv_s.insert(argv_s.end(), {"--port", "0", "--port_file", port_file});
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // The child must not inherit the coordinator's blocked shutdown signals.
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    auto text = ReadFileToString(port_file);
    if (text.ok() && !text->empty()) {
      RemoveAll(dir_template).IgnoreError();
      return ChildServer(pid, std::atoi(text->c_str()));
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      RemoveAll(dir_template).IgnoreError();
      return absl::InternalError(absl::StrCat("child exited during start-up (status ", status,
                                              "); see its stderr"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  RemoveAll(dir_template).IgnoreError();
  return absl::DeadlineExceededError(
      absl::StrCat("child did not report a port within ", timeout_seconds, " s"));
}

ChildServer::ChildServer(ChildServer&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), port_(other.port_) {}

ChildServer::~ChildServer() { Stop(); }

std::string ChildServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

void ChildServer::Stop() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {  // up to 10 s to shut down cleanly
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
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
