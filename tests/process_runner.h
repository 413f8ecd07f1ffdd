// Test helper: runs several real processes side by side (ranks of a c10d mesh), captures
// each one's stdout, and waits for all of them with a deadline (stragglers are killed).
#ifndef LORASTEP_TESTS_PROCESS_RUNNER_H_
#define LORASTEP_TESTS_PROCESS_RUNNER_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace lorastep {
namespace testing {

struct ProcessResult {
  int exit_code = -1;  // -1: killed at the deadline or by a signal
  int signal = 0;       // the signal that ended it, if one did
  std::string output;  // stdout, then a line naming that signal
};

// A TCP port free right now on 127.0.0.1.
inline int FreeTcpPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}


// CPU seconds process `pid` has used (user + system, from /proc/PID/stat); -1 when gone.
inline double ProcessCpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return -1;
  const size_t name_end = stat.rfind(')');
  if (name_end == std::string::npos) return -1;
  std::istringstream fields(stat.substr(name_end + 2));  // from field 3, the state
  std::string field;
  long long ticks = 0;
  for (int f = 3; f <= 15 && fields >> field; ++f) {
    if (f == 14 || f == 15) ticks += std::stoll(field);  // utime, stime
  }
  return static_cast<double>(ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Waits until process `pid` has used `cpu_seconds` more CPU than `since` (a
// ProcessCpuSeconds reading): it is computing, not idle. False after `timeout`.
inline bool WaitUntilComputing(int pid, double since, double cpu_seconds, std::chrono::seconds timeout) {
  bool computing = false;
  WaitFor(
      [&] {
        const double used = ProcessCpuSeconds(pid);
        computing = used >= 0 && used - since >= cpu_seconds;
        return used < 0 || computing;
      },
      timeout);
  return computing;
}

// Starts every command line at once; returns their results in order.
inline std::vector<ProcessResult> RunProcesses(const std::vector<std::vector<std::string>>& commands,
                                               const std::string& scratch, int timeout_seconds) {
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (size_t i = 0; i < commands.size(); ++i) {
    outs.push_back(scratch + "/proc_" + std::to_string(i) + ".out");
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(outs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      std::vector<char*> argv;
      for (const auto& a : commands[i]) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<ProcessResult> results(commands.size());
  std::vector<bool> done(commands.size(), false);
  size_t remaining = commands.size();
  const bool all_exited = WaitFor(
      [&] {
        for (size_t i = 0; i < pids.size(); ++i) {
          int status = 0;
          if (!done[i] && waitpid(pids[i], &status, WNOHANG) == pids[i]) {
            done[i] = true;
            --remaining;
            results[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
            if (WIFSIGNALED(status)) results[i].signal = WTERMSIG(status);
          }
        }
        return remaining == 0;
      },
      std::chrono::seconds(timeout_seconds), std::chrono::milliseconds(20));
  if (!all_exited) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (!done[i]) {
        kill(pids[i], SIGKILL);
        waitpid(pids[i], nullptr, 0);
      }
    }
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    std::ifstream in(outs[i]);
    std::stringstream ss;
    ss << in.rdbuf();
    results[i].output = ss.str();
    if (results[i].signal != 0) {
      results[i].output += "[ended by signal " + std::to_string(results[i].signal) + " (" +
                           strsignal(results[i].signal) + ")]\n";
    }
  }
  return results;
}

}  // namespace testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_PROCESS_RUNNER_H_
