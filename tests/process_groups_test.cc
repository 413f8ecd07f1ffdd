// Real processes, real c10d gloo groups over a TCPStore on loopback.
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "tests/process_runner.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::FreeTcpPort;
using ::lorastep::testing::RunProcesses;
using ::lorastep::testing::ScratchDir;

std::string ProbePath() { return lorastep::testing::TestBinary("tests/process_groups_probe"); }

// CPU (gloo) by default; with LORASTEP_TEST_DEVICE=cuda, NCCL with one GPU per rank, and a
// layout needing more GPUs than LORASTEP_TEST_GPUS is skipped.
bool OnCuda() {
  const char* d = std::getenv("LORASTEP_TEST_DEVICE");
  return d != nullptr && std::string(d).rfind("cuda", 0) == 0;
}
bool TooFewDevices(int world) {
  const char* gpus = std::getenv("LORASTEP_TEST_GPUS");
  return OnCuda() && world > (gpus != nullptr ? std::atoi(gpus) : 1);
}

std::vector<std::vector<std::string>> Commands(const std::string& scenario, int tp, int pp, int dp,
                                               int timeout_ms) {
  const int world = tp * pp * dp, port = FreeTcpPort();
  std::vector<std::vector<std::string>> cmds;
  for (int r = 0; r < world; ++r) {
    cmds.push_back({ProbePath(), scenario, std::to_string(r), std::to_string(world), std::to_string(tp),
                    std::to_string(pp), std::to_string(dp), std::to_string(port),
                    std::to_string(timeout_ms), OnCuda() ? "cuda" : "cpu"});
  }
  return cmds;
}

void ExpectCollectivesPass(int tp, int pp, int dp) {
  if (TooFewDevices(tp * pp * dp)) GTEST_SKIP() << "needs " << tp * pp * dp << " GPUs";
  auto results = RunProcesses(Commands("collectives", tp, pp, dp, 60000), ScratchDir("pg"), 240);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].output.find("OK"), std::string::npos) << "rank " << r << ": " << results[r].output;
  }
}

TEST(ProcessGroupsTest, EveryGroupOfTp2Pp2Dp2) { ExpectCollectivesPass(2, 2, 2); }
TEST(ProcessGroupsTest, EveryGroupOfDp2) { ExpectCollectivesPass(1, 1, 2); }

void ExpectErrorOnEveryOtherRank(const std::string& scenario, const std::string& want_code) {
  if (TooFewDevices(3)) GTEST_SKIP() << "needs 3 GPUs";
  constexpr int kTimeoutMs = 3000;
  // A surviving rank must exit with its error, never by a signal: nothing here retries a
  // crash away.
  // A hang is killed at 120 s: its ranks then exit by a signal.
  auto results = RunProcesses(Commands(scenario, 1, 1, 3, kTimeoutMs), ScratchDir(scenario), 120);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_NE(results[2].output.find("LEFT"), std::string::npos) << results[2].output;
  for (int r = 0; r < 2; ++r) {
    const std::string& out = results[r].output;
    EXPECT_EQ(results[r].exit_code, 0) << out;
    ASSERT_NE(out.find("ERROR "), std::string::npos) << "rank " << r << ": " << out;
    std::istringstream in(out.substr(out.find("ERROR ") + 6));
    std::string code, again;
    long ms = 0;
    in >> code >> ms >> again;
    EXPECT_EQ(code, want_code) << out;
    EXPECT_LE(ms, 10 * kTimeoutMs) << out;  // bounded by this timeout, not a default of minutes
    EXPECT_EQ(again, "FAILED_PRECONDITION") << out;  // broken until rebuilt
  }
}

// Deferred groups form nothing until Rebuild; after rank 0 (the store's server) is replaced
// by a new process serving a fresh store at the same address, the other rank reconnects at
// the next Rebuild and the collectives work again (it kept using the dead store before).
TEST(ProcessGroupsTest, ReplacedRankZeroServesAFreshStoreTheOthersReconnectTo) {
  if (TooFewDevices(2)) GTEST_SKIP() << "needs 2 GPUs";
  auto results = RunProcesses(Commands("replaced_rank0", 1, 1, 2, 20000), ScratchDir("pg_replaced_rank0"), 90);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].output.find("OK"), std::string::npos) << results[r].output;
  }
}

TEST(ProcessGroupsTest, DeadPeerIsAnErrorOnEveryRank) {
  ExpectErrorOnEveryOtherRank("dead_peer", "UNAVAILABLE");
}

TEST(ProcessGroupsTest, AbsentPeerTimesOutOnEveryRankWithinTheTimeout) {
  ExpectErrorOnEveryOtherRank("absent_peer", "DEADLINE_EXCEEDED");
}

}  // namespace
}  // namespace lorastep
