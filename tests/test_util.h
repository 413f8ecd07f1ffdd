// Test helpers: status assertions and scratch folders under TEST_TMPDIR.
#ifndef LORASTEP_TESTS_TEST_UTIL_H_
#define LORASTEP_TESTS_TEST_UTIL_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "lib/io/file_util.h"

#define LORASTEP_TEST_CONCAT_INNER_(a, b) a##b
#define LORASTEP_TEST_CONCAT_(a, b) LORASTEP_TEST_CONCAT_INNER_(a, b)

#define ASSERT_OK(expr)                                          \
  do {                                                           \
    auto lorastep_s_ = ::lorastep::testing::ToStatus(expr);      \
    ASSERT_TRUE(lorastep_s_.ok()) << lorastep_s_;                \
  } while (false)
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                                          \
  auto LORASTEP_TEST_CONCAT_(so_, __LINE__) = (expr);                            \
  ASSERT_TRUE(LORASTEP_TEST_CONCAT_(so_, __LINE__).ok())                         \
      << LORASTEP_TEST_CONCAT_(so_, __LINE__).status();                          \
  lhs = std::move(LORASTEP_TEST_CONCAT_(so_, __LINE__)).value()

namespace lorastep {
namespace testing {

inline absl::Status ToStatus(const absl::Status& s) { return s; }
template <typename T>
absl::Status ToStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

// Matches a status (or StatusOr) with `code` whose message contains `substring`.
MATCHER_P2(StatusIs, code, substring, "") {
  absl::Status s = ToStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code && s.message().find(substring) != absl::string_view::npos;
}

// A binary built with the tests: $LORASTEP_BIN_DIR (CMake build folder), else Bazel's
// runfiles. `bazel_path` is the label's path, e.g. "worker/lorastep_worker".
// The cluster secret the servers a test starts share, handed through the environment as an
// operator's supervisor would ($LORASTEP_CLUSTER_SECRET): workers started apart from their
// coordinator hold the same one. Call before starting servers.
inline constexpr char kTestClusterSecret[] = "test-cluster-secret-0123456789abcdef";
inline void ShareClusterSecretWithServers() { setenv("LORASTEP_CLUSTER_SECRET", kTestClusterSecret, /*overwrite=*/1); }
// The "authorization" metadata a test presents to a Worker or the Registry.
inline std::string ClusterAuthorization() { return absl::StrCat("Bearer ", kTestClusterSecret); }

inline std::string TestBinary(const std::string& bazel_path) {
  if (const char* dir = std::getenv("LORASTEP_BIN_DIR")) {
    return std::string(dir) + "/" + bazel_path.substr(bazel_path.rfind('/') + 1);
  }
  const char* runfiles = std::getenv("TEST_SRCDIR");
  return std::string(runfiles != nullptr ? runfiles : ".") + "/lorastep/" + bazel_path;
}

// A fresh, empty folder for one test.
inline std::string ScratchDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string root = base != nullptr ? base : "/tmp";
  std::string dir = absl::StrCat(root, "/lorastep_", name, "_", getpid());
  EXPECT_TRUE(RemoveAll(dir).ok());
  EXPECT_TRUE(MakeDirectories(dir).ok());
  return dir;
}

// Polls `done` until it returns true or `timeout` passes; returns whether it did. For what
// tests wait on that has no event to block on: another process's state, a file, a server's
// answer, a counter another thread moves.
template <typename Done>
bool WaitFor(Done done, std::chrono::milliseconds timeout = std::chrono::seconds(60),
             std::chrono::milliseconds poll = std::chrono::milliseconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(poll);  // the poll interval: the condition has no event to wait on
  }
  return true;
}

// Runs `call` on its own thread and waits up to `timeout` for it to return; returns whether
// it did. For a call whose contract is to return without waiting out something the test makes
// far longer than `timeout` (a spin, a window): a broken call then fails the test instead of
// passing slowly. (When it did not return, the wait for it continues as this returns.)
template <typename Call>
bool ReturnsWithin(Call call, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  std::future<void> done = std::async(std::launch::async, std::move(call));
  return done.wait_for(timeout) == std::future_status::ready;
}

// Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet.
inline bool ProcessGone(int pid) {
  auto stat = ReadFileToString(absl::StrCat("/proc/", pid, "/stat"));
  return !stat.ok() || stat->find(") Z ") != std::string::npos;
}

}  // namespace testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_TEST_UTIL_H_
