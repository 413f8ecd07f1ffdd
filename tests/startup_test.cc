// Start-up of the coordinator and the worker as real processes: a mesh too large for the
// machine or the model is refused by name before any worker starts, and a shutdown signal at
// any point of start-up ends every process at once.
#include <signal.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "lib/io/file_util.h"
#include "lib/model/model_config.h"
#include "server/local_mesh.h"
#include "tests/process_runner.h"
#include "tests/service_test_util.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using namespace ::lorastep::service_testing;  // NOLINT: the shared helpers, unqualified
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

TEST(LocalMeshTest, SizesAreCheckedBeforeTheyAreMultiplied) {
  EXPECT_TRUE(CheckMeshSizes({2, 2, 2, 1, 1}).ok());
  for (const auto& [sizes, named] : std::vector<std::pair<ParallelSizes, std::string>>{
           {{0, 1, 1, 1, 1}, "tp: 0 must be in [1, 4096]"},
           {{1, 1, 1, 1, 5000}, "cp: 5000 must be in [1, 4096]"},
           {{1, 1, 1, -3, 1}, "ep: -3 must be in [1, 4096]"},
           {{4096, 4096, 4096, 1, 1}, "tp/pp/dp/cp: a mesh of more than 4096 ranks"}}) {
    absl::Status s = CheckMeshSizes(sizes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << named;
    EXPECT_TRUE(absl::StartsWith(s.message(), named)) << s;
  }
}

TEST(LocalMeshTest, MeshIsCheckedAgainstTheMachineAndTheModel) {
  ASSERT_OK_AND_ASSIGN(std::string dir, TinyModelDir("local_mesh"));
  const std::string model = dir + "/model";
  const ModelConfig tiny = ModelConfigPreset("tiny").value();
  EXPECT_TRUE(CheckLocalMesh({2, 2, 2, 1, 1}, model, 8, "--max_local_workers").ok());
  absl::Status s = CheckLocalMesh({1, 1, 48, 1, 1}, model, 16, "--max_local_workers");
  EXPECT_TRUE(absl::StrContains(s.message(), "= 48 local workers is more than --max_local_workers (16)")) << s;
  s = CheckLocalMesh({2, 1, 1, 1, 1}, model, 1, "the GPUs this machine shows");
  EXPECT_TRUE(absl::StrContains(s.message(), "more than the GPUs this machine shows (1)")) << s;
  const int heads = static_cast<int>(tiny.num_attention_heads);
  s = CheckLocalMesh({heads + 1, 1, 1, 1, 1}, model, 4096, "--max_local_workers");
  EXPECT_TRUE(absl::StartsWith(s.message(), absl::StrCat("tp: ", heads + 1, " does not divide num_attention_heads")))
      << s;
  s = CheckLocalMesh({1, 1, 2, 2, 1}, model, 16, "--max_local_workers");
  EXPECT_TRUE(absl::StartsWith(s.message(), "ep: 2 needs a MoE model")) << s;
  s = CheckLocalMesh({1, 1, 2, 1, 1}, dir + "/nothing-here", 16, "--max_local_workers");
  EXPECT_TRUE(absl::StartsWith(s.message(), "model: cannot read")) << s;
  setenv("CUDA_VISIBLE_DEVICES", "0,1, 3", 1);
  EXPECT_EQ(VisibleCudaDevices(), 3);
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  EXPECT_EQ(VisibleCudaDevices(), 0);
  unsetenv("CUDA_VISIBLE_DEVICES");
}

// Runs the coordinator with `flags`; returns (exit code, output, seconds taken).
struct Outcome {
  int exit_code;
  std::string output;
  double seconds;
};
Outcome RunCoordinator(const std::string& dir, const std::string& flags) {
  const auto t0 = Clock::now();
  auto r = testing::RunProcesses(
      {{"/bin/sh", "-c",
        absl::StrCat(Binary("server/lorastep_coordinator"), " --port 0 --worker_binary ",
                     Binary("worker/lorastep_worker"), " --model ", dir, "/model ", flags, " 2>&1")}},
      dir, 120);
  return {r[0].exit_code, r[0].output, SecondsSince(t0)};
}

// A worker refuses a sampler cache size out of range, naming the flag, before it serves.
TEST(StartupTest, WorkerRefusesABadKvCacheSize) {
  ASSERT_OK_AND_ASSIGN(std::string dir, TinyModelDir("kv_cache_flag"));
  for (const char* mb : {"-1", "1048577"}) {
    auto r = testing::RunProcesses({{"/bin/sh", "-c",
                                     absl::StrCat(Binary("worker/lorastep_worker"), " --port 0 --model ", dir,
                                                  "/model --kv_cache_mb ", mb, " 2>&1")}},
                                   dir, 60);
    EXPECT_NE(r[0].exit_code, 0) << mb;
    EXPECT_TRUE(absl::StrContains(r[0].output, "--kv_cache_mb: " + std::string(mb) + " is not in")) << r[0].output;
    EXPECT_FALSE(absl::StrContains(r[0].output, "serving")) << r[0].output;
  }
}

// Processes (other than zombies) whose arguments include `--model <dir>/model`.
int WorkerProcessesUnder(const std::string& dir) {
  const std::string model = dir + "/model";
  int n = 0;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  while (dirent* e = readdir(proc)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    auto cmdline = ReadFileToString(absl::StrCat("/proc/", pid, "/cmdline"));
    auto stat = ReadFileToString(absl::StrCat("/proc/", pid, "/stat"));
    if (!cmdline.ok() || !stat.ok() || stat->find(") Z ") != std::string::npos) continue;
    const std::vector<std::string> args = absl::StrSplit(*cmdline, '\0');
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == "--model" && args[i + 1] == model) {
        ++n;
        break;
      }
    }
  }
  closedir(proc);
  return n;
}

// Issue 55, point 6: --cp 1000 started 424 workers before anything said no; --dp 48 started
// 48; --tp 48 started all 48 before a worker found 48 does not divide the heads.
TEST(StartupTest, OversizedMeshIsRefusedBeforeAnyWorkerStarts) {
  ASSERT_OK_AND_ASSIGN(std::string dir, TinyModelDir("oversized_mesh"));
  double slowest = 0;
  for (const auto& [flags, named] : std::vector<std::pair<std::string, std::string>>{
           {"--cp 1000", "= 1000 local workers is more than --max_local_workers (16)"},
           {"--dp 48", "= 48 local workers is more than --max_local_workers (16)"},
           {"--tp 48 --max_local_workers 64", "tp: 48 does not divide num_attention_heads"},
           {"--tp 100000 --dp 100000", "tp: 100000 must be in [1, 4096]"},
           {"--dp 2 --device cuda", "more than the GPUs this machine shows"}}) {
    Outcome o = RunCoordinator(dir, flags);
    EXPECT_NE(o.exit_code, 0) << flags;
    EXPECT_TRUE(absl::StrContains(o.output, named)) << flags << ": " << o.output;
    EXPECT_FALSE(absl::StrContains(o.output, "lorastep_worker: serving")) << flags << ": a worker started";
    slowest = std::max(slowest, o.seconds);
  }
  std::printf("oversized_mesh_refused_s=%.3f\n", slowest);
}

// Issue 55, point 6: a coordinator starting its workers ignored SIGTERM until it served (and
// a SIGTERMed worker loading its model did too). Here the worker's model folder holds a FIFO
// as config.json, so the worker's start-up blocks reading it for as long as the test wants.
TEST(StartupTest, SigtermDuringStartUpEndsEveryProcessAtOnce) {
  const std::string dir = ScratchDir("startup_sigterm");
  ASSERT_TRUE(MakeDirectories(dir + "/model").ok());
  ASSERT_EQ(mkfifo((dir + "/model/config.json").c_str(), 0600), 0);
  for (const bool worker_alone : {true, false}) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string model = dir + "/model";
      if (worker_alone) {
        const std::string bin = Binary("worker/lorastep_worker");
        execl(bin.c_str(), bin.c_str(), "--model", model.c_str(), "--port", "0", static_cast<char*>(nullptr));
      } else {
        const std::string bin = Binary("server/lorastep_coordinator");
        const std::string worker = Binary("worker/lorastep_worker");
        execl(bin.c_str(), bin.c_str(), "--model", model.c_str(), "--port", "0", "--worker_binary", worker.c_str(),
              static_cast<char*>(nullptr));
      }
      _exit(127);
    }
    ASSERT_GT(pid, 0);
    // Until the worker blocks on its config (it has started and is loading).
    const bool loading = testing::WaitFor([&] { return WorkerProcessesUnder(dir) >= (worker_alone ? 1 : 2); },
                                          std::chrono::seconds(10), std::chrono::milliseconds(100));
    ASSERT_TRUE(loading) << (worker_alone ? "worker" : "coordinator + worker");
    // Into its loading: the process shows no state between "started" and "blocked on the
    // config" that a test could read.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ASSERT_EQ(kill(pid, SIGTERM), 0);
    int status = 0;
    pid_t done = 0;
    testing::WaitFor([&] { return (done = waitpid(pid, &status, WNOHANG)) != 0; }, std::chrono::seconds(60),
                     std::chrono::milliseconds(20));
    if (done == 0) kill(pid, SIGKILL), waitpid(pid, &status, 0);
    EXPECT_NE(done, 0) << "still starting 60 s after SIGTERM (blocked on its config, which never comes)";
    // Nothing it started outlives it.
    int left = -1;
    testing::WaitFor([&] { return (left = WorkerProcessesUnder(dir)) == 0; }, std::chrono::seconds(5),
                     std::chrono::milliseconds(100));
    EXPECT_EQ(left, 0) << "processes left behind";
  }
}

}  // namespace
}  // namespace lorastep
