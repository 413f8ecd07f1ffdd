// The call pipe (rpc/call_pipe.h) over a real socket pair: answers reach their callers in any
// order, failures and cancellations travel both ways, and a peer that goes away or breaks
// the framing fails the calls in flight instead of leaving them waiting.
#include "rpc/call_pipe.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/child_server.h"

namespace lorastep {
namespace {

using std::chrono::milliseconds;
using std::chrono::system_clock;

system_clock::time_point In(milliseconds ms) { return system_clock::now() + ms; }

struct Pair {
  Pair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0); }
  int fds[2] = {-1, -1};
};

TEST(CallPipeTest, AnswersReachTheirCallersInAnyOrder) {
  Pair pair;
  std::mutex mu;
  std::vector<CallPipeServer::Respond> held;  // answered in reverse arrival order
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, std::string payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    std::lock_guard<std::mutex> lock(mu);
    held.push_back([respond, method, payload](const absl::Status&, std::string) {
      respond(absl::OkStatus(), std::to_string(method) + ":" + payload);
    });
    if (held.size() == 3) {
      for (auto it = held.rbegin(); it != held.rend(); ++it) (*it)(absl::OkStatus(), "");
    }
  });
  CallPipeClient client(pair.fds[0], "test");
  std::vector<std::future<absl::StatusOr<std::string>>> calls;
  for (int i = 0; i < 3; ++i) {
    calls.push_back(std::async(std::launch::async, [&client, i] {
      return client.Call(static_cast<uint8_t>(i + 1), std::string(100000 * (i + 1), 'a' + i), In(milliseconds(20000)));
    }));
  }
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::string> answer = calls[i].get();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(*answer, std::to_string(i + 1) + ":" + std::string(100000 * (i + 1), 'a' + i));
  }
}

// The callers read the pipe themselves, one at a time: when the reading caller's deadline
// passes, a caller still waiting takes over and gets its answer.
TEST(CallPipeTest, AWaitingCallerTakesOverReadingWhenTheReaderGivesUp) {
  Pair pair;
  std::mutex mu;
  std::vector<std::thread> answering;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, std::string payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    if (method != 2) return;  // the first call is never answered
    std::lock_guard<std::mutex> lock(mu);
    answering.emplace_back([respond, payload] {
      std::this_thread::sleep_for(milliseconds(500));
      respond(absl::OkStatus(), "late:" + payload);
    });
  });
  CallPipeClient client(pair.fds[0], "test");
  auto gives_up = std::async(std::launch::async, [&] { return client.Call(1, "a", In(milliseconds(150))); });
  std::this_thread::sleep_for(milliseconds(20));  // the first call is reading by now
  absl::StatusOr<std::string> answered = client.Call(2, "b", In(milliseconds(20000)));
  EXPECT_EQ(gives_up.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(*answered, "late:b");
  std::lock_guard<std::mutex> lock(mu);
  for (std::thread& t : answering) t.join();
}

TEST(CallPipeTest, TheCalleesFailureReachesTheCaller) {
  Pair pair;
  CallPipeServer server(pair.fds[1], 1 << 20, [](uint8_t, std::string, std::function<bool()>,
                                                 CallPipeServer::Respond respond) {
    respond(absl::FailedPreconditionError("learner_version: 3 is not 4"), "ignored");
  });
  CallPipeClient client(pair.fds[0], "test");
  absl::StatusOr<std::string> answer = client.Call(1, "x", In(milliseconds(20000)));
  EXPECT_EQ(answer.status(), absl::FailedPreconditionError("learner_version: 3 is not 4"));
}

TEST(CallPipeTest, DeadlineEndsTheCallAndTheCalleeSeesItCancelled) {
  Pair pair;
  std::promise<std::function<bool()>> seen;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t, std::string, std::function<bool()> cancelled,
                                                  CallPipeServer::Respond) { seen.set_value(cancelled); });
  CallPipeClient client(pair.fds[0], "test");
  absl::StatusOr<std::string> answer = client.Call(1, "x", In(milliseconds(200)));
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded) << answer.status();
  std::function<bool()> cancelled = seen.get_future().get();
  EXPECT_TRUE(cancelled());
}

TEST(CallPipeTest, CancelAllEndsEveryCallAndTellsTheCallee) {
  Pair pair;
  std::promise<std::function<bool()>> seen;
  CallPipeServer::Respond kept;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, std::string, std::function<bool()> cancelled,
                                                  CallPipeServer::Respond respond) {
    if (method != 1) return;  // the second call is left unanswered
    kept = respond;
    seen.set_value(cancelled);
  });
  CallPipeClient client(pair.fds[0], "test");
  auto call = std::async(std::launch::async, [&] { return client.Call(1, "x", In(milliseconds(60000))); });
  std::function<bool()> cancelled = seen.get_future().get();
  EXPECT_FALSE(cancelled());
  client.CancelAll();
  EXPECT_EQ(call.get().status().code(), absl::StatusCode::kCancelled);
  for (int i = 0; i < 500 && !cancelled(); ++i) std::this_thread::sleep_for(milliseconds(2));
  EXPECT_TRUE(cancelled());
  kept(absl::OkStatus(), "late");  // an answer nobody waits for is dropped
  absl::StatusOr<std::string> next = client.Call(2, "y", In(milliseconds(200)));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kDeadlineExceeded);  // the pipe still works
}

TEST(CallPipeTest, ACalleeThatGoesAwayFailsTheCallsInFlightAndLater) {
  Pair pair;
  auto server = std::make_unique<CallPipeServer>(
      pair.fds[1], 1 << 20, [](uint8_t, std::string, std::function<bool()>, CallPipeServer::Respond) {});
  CallPipeClient client(pair.fds[0], "127.0.0.1:1");
  auto call = std::async(std::launch::async, [&] { return client.Call(1, "x", In(milliseconds(60000))); });
  std::this_thread::sleep_for(milliseconds(50));
  server.reset();  // as the worker's exit closes its end
  absl::Status status = call.get().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("127.0.0.1:1"), std::string::npos) << status;
  EXPECT_EQ(client.Call(1, "x", In(milliseconds(60000))).status().code(), absl::StatusCode::kUnavailable);
}

TEST(CallPipeTest, ACallOverTheLimitClosesThePipeBeforeItsPayloadIsRead) {
  Pair pair;
  std::atomic<int> handled{0};
  CallPipeServer server(pair.fds[1], 1000, [&](uint8_t, std::string, std::function<bool()>,
                                               CallPipeServer::Respond respond) {
    ++handled;
    respond(absl::OkStatus(), "");
  });
  CallPipeClient client(pair.fds[0], "test");
  EXPECT_TRUE(client.Call(1, std::string(1000, 'x'), In(milliseconds(20000))).ok());
  absl::Status over = client.Call(1, std::string(1001, 'x'), In(milliseconds(20000))).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kUnavailable) << over;
  EXPECT_EQ(handled.load(), 1);
}

TEST(CallPipeTest, ReadingRefusesWhatIsNotAFrame) {
  Pair pair;
  const std::string junk(40, 'z');
  ASSERT_EQ(write(pair.fds[0], junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  EXPECT_EQ(ReadCallFrame(pair.fds[1], 1 << 20).status().code(), absl::StatusCode::kDataLoss);
  close(pair.fds[0]);
  EXPECT_EQ(ReadCallFrame(pair.fds[1], 1 << 20).status().code(), absl::StatusCode::kUnavailable);
  close(pair.fds[1]);
}

TEST(CallPipeTest, AFrameRoundTripsWithItsFields) {
  Pair pair;
  CallFrame frame;
  frame.kind = CallFrameKind::kAnswer;
  frame.method = 7;
  frame.code = absl::StatusCode::kResourceExhausted;
  frame.call_id = 1ull << 40;
  frame.deadline_unix_us = 1234567;
  frame.message = "too big";
  frame.payload = std::string(300000, 'p');  // larger than the socket's buffer: written in parts
  const std::string tail(70000, 't');
  frame.payload_tail = {"-head-", tail, "", "-end"};  // written uncopied after the payload
  std::thread writer([&] { EXPECT_TRUE(WriteCallFrame(pair.fds[0], frame).ok()); });
  absl::StatusOr<CallFrame> read = ReadCallFrame(pair.fds[1], 1 << 20);
  writer.join();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->kind, frame.kind);
  EXPECT_EQ(read->method, frame.method);
  EXPECT_EQ(read->code, frame.code);
  EXPECT_EQ(read->call_id, frame.call_id);
  EXPECT_EQ(read->deadline_unix_us, frame.deadline_unix_us);
  EXPECT_EQ(read->message, frame.message);
  EXPECT_EQ(read->payload, frame.payload + "-head-" + tail + "-end");
  close(pair.fds[0]);
  close(pair.fds[1]);
}

// A worker's call pipe that cannot be made (no descriptor left) fails the start, naming what
// failed, and starts no child. The binary exists (this test's own), so the start gets as far
// as the pipe.
TEST(CallPipeTest, AStartWhosePipeCannotBeMadeFails) {
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;  // every descriptor below the limit taken
  for (int fd = dup(0); fd >= 0; fd = dup(0)) filler.push_back(fd);
  absl::StatusOr<ChildServer> child = ChildServer::Start("/proc/self/exe", {}, 5, /*call_pipe=*/true);
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_FALSE(child.ok());
  EXPECT_NE(child.status().message().find("socketpair for a child's call pipe"), std::string::npos) << child.status();
}

}  // namespace
}  // namespace lorastep
