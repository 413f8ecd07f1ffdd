// The call pipe (rpc/call_pipe.h) over a real socket pair: answers reach their callers in any
// order, failures and cancellations travel both ways, and a peer that goes away or breaks
// the framing fails the calls in flight instead of leaving them waiting.
#include "rpc/call_pipe.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/child_server.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using std::chrono::milliseconds;
using std::chrono::system_clock;

system_clock::time_point In(milliseconds ms) { return system_clock::now() + ms; }

struct Pair {
  Pair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0); }
  int fds[2] = {-1, -1};
};

// Runs `f` with every file descriptor taken (the limit lowered to 256 and the rest filled),
// then gives them back.
template <typename F>
void WithNoDescriptorLeft(F f) {
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> filler;
  for (int fd = dup(0); fd >= 0; fd = dup(0)) filler.push_back(fd);
  f();
  for (int fd : filler) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
}

// A callee that answers each call with `answer(payload)` and counts the calls it got and the
// payloads it read from the caller's shared region.
struct CountingCallee {
  CountingCallee(int fd, std::function<std::string(absl::string_view)> answer, uint64_t max_call_bytes = 4 << 20,
                 milliseconds poll_after_answer = milliseconds(0))
      : server(
            fd, max_call_bytes,
            [this, answer](uint8_t, CallPayload payload, std::function<bool()>, CallPipeServer::Respond respond) {
              ++calls;
              if (payload.in_shared_region()) ++in_region;
              respond(absl::OkStatus(), answer(payload.bytes()));
            },
            poll_after_answer) {}
  std::atomic<int> calls{0};
  std::atomic<int> in_region{0};
  CallPipeServer server;
};

std::string Nothing(absl::string_view) { return ""; }

TEST(CallPipeTest, AnswersReachTheirCallersInAnyOrder) {
  Pair pair;
  std::mutex mu;
  std::vector<CallPipeServer::Respond> held;  // answered in reverse arrival order
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    std::lock_guard<std::mutex> lock(mu);
    held.push_back([respond, method, text = std::string(payload.bytes())](const absl::Status&, std::string) {
      respond(absl::OkStatus(), std::to_string(method) + ":" + text);
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

// Many calls answered together, in the order they came, none with a deadline: the reading
// caller's own answer comes first, and it hands the reader's turn to a caller still waiting
// (each waiting caller is woken alone, for its answer or for the turn), so every call returns.
TEST(CallPipeTest, TheReaderHandsItsTurnOnWhenItsOwnAnswerCame) {
  Pair pair;
  constexpr int kCalls = 16;
  std::mutex mu;
  std::vector<std::pair<CallPipeServer::Respond, std::string>> held;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    std::lock_guard<std::mutex> lock(mu);
    held.emplace_back(std::move(respond), std::string(payload.bytes()));
    if (held.size() == kCalls) {
      for (auto& [answer, text] : held) answer(absl::OkStatus(), "re:" + text);
    }
  });
  CallPipeClient client(pair.fds[0], "test");
  std::vector<std::future<absl::StatusOr<std::string>>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::async(std::launch::async, [&client, i] {
      return client.Call(1, std::to_string(i), std::chrono::system_clock::time_point::max());
    }));
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_EQ(calls[i].wait_for(std::chrono::seconds(60)), std::future_status::ready) << "call " << i;
    absl::StatusOr<std::string> answer = calls[i].get();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(*answer, "re:" + std::to_string(i));
  }
}

// The callers read the pipe themselves, one at a time: when the reading caller's deadline
// passes, a caller still waiting takes over and gets its answer.
TEST(CallPipeTest, AWaitingCallerTakesOverReadingWhenTheReaderGivesUp) {
  Pair pair;
  std::mutex mu;
  std::vector<std::thread> answering;
  std::atomic<bool> first_arrived{false};
  std::shared_future<absl::StatusOr<std::string>> gives_up;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    if (method != 2) {  // the first call is never answered
      first_arrived = true;
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    answering.emplace_back([respond, text = std::string(payload.bytes()), gives_up] {
      gives_up.wait();  // answered after the first call gave up
      respond(absl::OkStatus(), "late:" + text);
    });
  });
  CallPipeClient client(pair.fds[0], "test");
  gives_up = std::async(std::launch::async, [&] { return client.Call(1, "a", In(milliseconds(150))); }).share();
  ASSERT_TRUE(testing::WaitFor([&] { return first_arrived.load(); }));  // the first call is reading by now
  absl::StatusOr<std::string> answered = client.Call(2, "b", In(milliseconds(20000)));
  EXPECT_EQ(gives_up.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(*answered, "late:b");
  std::lock_guard<std::mutex> lock(mu);
  for (std::thread& t : answering) t.join();
}

TEST(AnswerWindowsTest, TheWindowSpansTheRecentDurationsWithMargins) {
  AnswerWindows windows;
  const AnswerWindows::Clock::time_point start{};
  EXPECT_FALSE(windows.For(1, start).known);  // nothing answered yet
  windows.Record(1, milliseconds(190));
  windows.Record(1, milliseconds(195));
  windows.Record(1, milliseconds(192));
  AnswerWindows::Window w = windows.For(1, start);
  ASSERT_TRUE(w.known);
  // 1% (1.9 ms) before the shortest, 1% (1.95 ms, less than 2 ms) after the longest
  EXPECT_EQ(w.opens - start, std::chrono::microseconds(190000 - 1900));
  EXPECT_EQ(w.closes - start, std::chrono::microseconds(195000 + 2000));
  EXPECT_FALSE(windows.For(2, start).known);  // another kind
  windows.Record(1, milliseconds(240));  // replaces the oldest (190): too spread to poll through
  EXPECT_FALSE(windows.For(1, start).known);
  windows.Record(9, milliseconds(5));  // no such kind: ignored
  EXPECT_FALSE(windows.For(9, start).known);
}

double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// With polling on, the waiting caller polls near the answer's expected time (it spends CPU
// time there) and still gets every answer; with it off, it sleeps through the call. A deadline
// inside the window still ends the call.
TEST(CallPipeTest, AWaitingCallerPollsForItsAnswerNearItsExpectedTime) {
  Pair pair;
  std::vector<std::thread> answering;
  std::mutex mu;
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    std::lock_guard<std::mutex> lock(mu);
    answering.emplace_back([respond, text = std::string(payload.bytes())] {
      // Answers late on purpose: the test is about when a waiting caller polls, which is time.
      std::this_thread::sleep_for(milliseconds(text == "never" ? 300 : 40));
      respond(absl::OkStatus(), "re:" + text);
    });
  });
  CallPipeClient client(pair.fds[0], "test");
  auto call_cpu_ms = [&](const std::string& text) {
    const double before = ThreadCpuMs();
    absl::StatusOr<std::string> answer = client.Call(1, text, In(milliseconds(20000)));
    EXPECT_TRUE(answer.ok()) << answer.status();
    if (answer.ok()) {
      EXPECT_EQ(*answer, "re:" + text);
    }
    return ThreadCpuMs() - before;
  };
  for (int i = 0; i < 3; ++i) EXPECT_LT(call_cpu_ms("sleeping" + std::to_string(i)), 1.0);
  client.set_poll_for_answers(true);
  double most = 0;
  // A loaded machine stretches the callee's sleeps: the durations then spread too widely for a
  // window, or an answer lands before it; a few calls in a row settle it.
  for (int i = 0; i < 12 && most <= 0.3; ++i) most = std::max(most, call_cpu_ms("polling" + std::to_string(i)));
  EXPECT_GT(most, 0.3);  // polled from about a millisecond before the answer landed
  // The window opens about 39 ms after the call: a deadline at 41 ms passes while polling
  // (the callee answers "never" after 300 ms: a caller that missed its deadline gets that answer).
  absl::StatusOr<std::string> late = client.Call(1, "never", In(milliseconds(41)));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  std::lock_guard<std::mutex> lock(mu);
  for (std::thread& t : answering) t.join();
}

double ProcessCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// With poll_after_answer, the callee's reader polls for the next call after each answer (the
// process spends CPU time while the caller idles) and serves the calls that come meanwhile and
// after; without it, it sleeps. Destroying the callee while its reader polls ends it.
TEST(CallPipeTest, TheCalleesReaderPollsForTheNextCallAfterEachAnswer) {
  for (const int poll_ms : {0, 200}) {
    SCOPED_TRACE(poll_ms);
    Pair pair;
    auto callee = std::make_unique<CountingCallee>(
        pair.fds[1], [](absl::string_view p) { return "re:" + std::string(p); }, 1 << 20, milliseconds(poll_ms));
    CallPipeClient client(pair.fds[0], "test");
    ASSERT_EQ(client.Call(1, "a", In(milliseconds(20000))).value_or(""), "re:a");
    const double before = ProcessCpuMs();
    std::this_thread::sleep_for(milliseconds(60));  // the CPU the reader uses over an idle 60 ms is the figure
    const double idle_cpu_ms = ProcessCpuMs() - before;
    if (poll_ms > 0) {
      EXPECT_GT(idle_cpu_ms, 5);  // the reader polled through the 60 ms (a loaded machine gives it less of them)
    } else {
      EXPECT_LT(idle_cpu_ms, 5);
    }
    EXPECT_EQ(client.Call(1, "b", In(milliseconds(20000))).value_or(""), "re:b");  // during its polling, or after
    std::this_thread::sleep_for(milliseconds(300));  // past the 200 ms polling window: the reader sleeps
    EXPECT_EQ(client.Call(1, "c", In(milliseconds(20000))).value_or(""), "re:c");
    callee.reset();  // polling again after "c": ends anyway
    EXPECT_EQ(client.Call(1, "d", In(milliseconds(20000))).status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST(CallPipeTest, TheCalleesFailureReachesTheCaller) {
  Pair pair;
  CallPipeServer server(pair.fds[1], 1 << 20, [](uint8_t, CallPayload, std::function<bool()>,
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
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t, CallPayload, std::function<bool()> cancelled,
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
  CallPipeServer server(pair.fds[1], 1 << 20, [&](uint8_t method, CallPayload, std::function<bool()> cancelled,
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
  testing::WaitFor([&] { return cancelled(); }, std::chrono::seconds(5), milliseconds(2));
  EXPECT_TRUE(cancelled());
  kept(absl::OkStatus(), "late");  // an answer nobody waits for is dropped
  absl::StatusOr<std::string> next = client.Call(2, "y", In(milliseconds(200)));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kDeadlineExceeded);  // the pipe still works
}

TEST(CallPipeTest, ACalleeThatGoesAwayFailsTheCallsInFlightAndLater) {
  Pair pair;
  std::atomic<bool> arrived{false};
  auto server = std::make_unique<CallPipeServer>(
      pair.fds[1], 1 << 20, [&](uint8_t, CallPayload, std::function<bool()>, CallPipeServer::Respond) { arrived = true; });
  CallPipeClient client(pair.fds[0], "127.0.0.1:1");
  auto call = std::async(std::launch::async, [&] { return client.Call(1, "x", In(milliseconds(60000))); });
  ASSERT_TRUE(testing::WaitFor([&] { return arrived.load(); }));  // the call is in flight
  server.reset();  // as the worker's exit closes its end
  absl::Status status = call.get().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("127.0.0.1:1"), std::string::npos) << status;
  EXPECT_EQ(client.Call(1, "x", In(milliseconds(60000))).status().code(), absl::StatusCode::kUnavailable);
}

// A staged tail whose call finds the pipe closed frees its span, whether the client already
// knew (a call in flight saw the end of the stream) or learns it writing.
TEST(CallPipeTest, AStagedTailWhoseCallFindsThePipeClosedFreesItsSpan) {
  for (const bool known : {true, false}) {
    Pair pair;
    std::atomic<bool> arrived{false};
    auto callee = std::make_unique<CallPipeServer>(
        pair.fds[1], 4 << 20, [&](uint8_t, CallPayload, std::function<bool()>, CallPipeServer::Respond) { arrived = true; });
    CallPipeClient client(pair.fds[0], "test", 4 << 20, /*region_bytes=*/1 << 20);
    const std::string big(800000, 'z');
    std::shared_ptr<const StagedTail> staged = client.Stage(64, {big});
    ASSERT_NE(staged, nullptr);
    if (known) {
      auto in_flight = std::async(std::launch::async, [&] { return client.Call(1, "x", In(milliseconds(60000))); });
      ASSERT_TRUE(testing::WaitFor([&] { return arrived.load(); }));  // the call is in flight
      callee.reset();  // the worker's end closes; the waiting call reads the end of the stream
      EXPECT_EQ(in_flight.get().status().code(), absl::StatusCode::kUnavailable);
    } else {
      callee.reset();
    }
    EXPECT_EQ(client.Call(1, "x", In(milliseconds(20000)), {big}, staged.get()).status().code(),
              absl::StatusCode::kUnavailable)
        << known;
    EXPECT_NE(client.Stage(64, {big}), nullptr) << "the staged tail's span is free again; known " << known;
  }
}

TEST(CallPipeTest, ACallOverTheLimitClosesThePipeBeforeItsPayloadIsRead) {
  Pair pair;
  CountingCallee callee(pair.fds[1], Nothing, 1000);
  CallPipeClient client(pair.fds[0], "test");
  EXPECT_TRUE(client.Call(1, std::string(1000, 'x'), In(milliseconds(20000))).ok());
  absl::Status over = client.Call(1, std::string(1001, 'x'), In(milliseconds(20000))).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kUnavailable) << over;
  EXPECT_EQ(callee.calls.load(), 1);
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

// A header as the pipe lays it out (rpc/call_pipe.cc's FrameHeader, 40 bytes little-endian).
std::string Header(uint8_t kind, uint16_t flags, uint64_t payload_bytes) {
  std::string h(40, '\0');
  const uint32_t magic = 0x3150534c;
  std::memcpy(&h[0], &magic, 4);
  h[4] = static_cast<char>(kind);
  std::memcpy(&h[6], &flags, 2);
  std::memcpy(&h[32], &payload_bytes, 8);
  return h;
}

// Flags the reader does not know, and a payload-in-region flag on anything but a call or with
// anything but a 16-byte span after it, are not frames.
TEST(CallPipeTest, ReadingRefusesFlagsItDoesNotKnow) {
  for (const std::string& header : {Header(1, 2, 0), Header(2, 1, 16), Header(1, 1, 15), Header(1, 1, 17)}) {
    Pair pair;
    const std::string bytes = header + std::string(17, 'x');
    ASSERT_EQ(write(pair.fds[0], bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    EXPECT_EQ(ReadCallFrame(pair.fds[1], 1 << 20).status().code(), absl::StatusCode::kDataLoss);
    close(pair.fds[0]);
    close(pair.fds[1]);
  }
  Pair pair;  // the well-formed one
  const std::string bytes = Header(1, 1, 16) + std::string(16, '\0');
  ASSERT_EQ(write(pair.fds[0], bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  absl::StatusOr<CallFrame> frame = ReadCallFrame(pair.fds[1], 1 << 20);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_TRUE(frame->payload_in_region);
  close(pair.fds[0]);
  close(pair.fds[1]);
}

// Where the region cannot be made (here: no descriptor left for the memfd), calls go through
// the socket as without one.
TEST(CallPipeTest, WithoutARegionCallsGoInline) {
  Pair pair;
  CountingCallee callee(pair.fds[1], [](absl::string_view payload) { return std::string(payload.substr(0, 1)); });
  std::unique_ptr<CallPipeClient> client;
  WithNoDescriptorLeft([&] { client = std::make_unique<CallPipeClient>(pair.fds[0], "test", 4 << 20, 1 << 20); });
  EXPECT_FALSE(client->shares_region());
  absl::StatusOr<std::string> answer = client->Call(1, std::string(300000, 'q'), In(milliseconds(20000)));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, "q");
  EXPECT_EQ(callee.in_region.load(), 0);
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

// With a shared region, a large payload is copied into a span of it and read in place by the
// callee; spans come back as calls are answered (a call whose caller gave up included), a
// payload that finds no free span goes inline, and so does a small one.
TEST(CallPipeTest, LargePayloadsTravelThroughTheSharedRegion) {
  Pair pair;
  std::mutex mu;
  std::vector<std::pair<std::string, CallPipeServer::Respond>> held;  // answered once three arrive
  std::atomic<int> in_region{0}, inline_payloads{0};
  CallPipeServer server(pair.fds[1], 4 << 20, [&](uint8_t method, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    (payload.in_shared_region() ? in_region : inline_payloads)++;
    std::string text(payload.bytes());
    if (method != 9) return respond(absl::OkStatus(), std::to_string(text.size()) + ":" + text.substr(0, 3));
    std::lock_guard<std::mutex> lock(mu);
    held.emplace_back(std::move(text), std::move(respond));
    if (held.size() < 3) return;
    for (auto& [t, r] : held) r(absl::OkStatus(), t);
    held.clear();
  });
  CallPipeClient client(pair.fds[0], "test", 1 << 20, /*region_bytes=*/1 << 20);
  ASSERT_TRUE(client.shares_region());
  // Three calls in flight at once: two fit in the region's MiB, the third goes inline.
  std::vector<std::future<absl::StatusOr<std::string>>> calls;
  for (int i = 0; i < 3; ++i) {
    calls.push_back(std::async(std::launch::async, [&client, i] {
      const std::string tail(100000, 'A' + i);
      return client.Call(9, std::string(300000, 'a' + i), In(milliseconds(20000)), {"|", tail});
    }));
  }
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::string> answer = calls[i].get();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(*answer, std::string(300000, 'a' + i) + "|" + std::string(100000, 'A' + i)) << i;
  }
  EXPECT_EQ(in_region.load(), 2);
  EXPECT_EQ(inline_payloads.load(), 1);
  // The spans are free again: one after another, calls of most of the region all go through it.
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::string> answer = client.Call(1, std::string(900000, 'x' + i % 2), In(milliseconds(20000)));
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(*answer, std::string("900000:") + std::string(3, 'x' + i % 2));
  }
  EXPECT_EQ(in_region.load(), 22);
  // A small payload goes inline.
  ASSERT_TRUE(client.Call(1, "tiny", In(milliseconds(20000))).ok());
  EXPECT_EQ(inline_payloads.load(), 2);
}

// A callee answers late, after its caller gave up: the span is held until that answer comes,
// then reused.
TEST(CallPipeTest, ASpanIsHeldUntilTheCalleeAnswersEvenAfterTheCallerGaveUp) {
  Pair pair;
  std::promise<CallPipeServer::Respond> first;
  std::atomic<int> in_region{0};
  std::atomic<bool> first_seen{false};
  CallPipeServer server(pair.fds[1], 4 << 20, [&](uint8_t method, CallPayload payload, std::function<bool()>,
                                                  CallPipeServer::Respond respond) {
    if (payload.in_shared_region()) ++in_region;
    if (method == 1 && !first_seen.exchange(true)) return first.set_value(std::move(respond));
    respond(absl::OkStatus(), std::string(payload.bytes().substr(0, 1)));
  });
  CallPipeClient client(pair.fds[0], "test", 1 << 20, /*region_bytes=*/1 << 20);
  EXPECT_EQ(client.Call(1, std::string(700000, 'a'), In(milliseconds(100))).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // The first span is still the callee's: this one does not fit beside it and goes inline.
  absl::StatusOr<std::string> second = client.Call(2, std::string(700000, 'b'), In(milliseconds(20000)));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, "b");
  EXPECT_EQ(in_region.load(), 1);
  first.get_future().get()(absl::OkStatus(), "late");  // read (and dropped) by the next caller
  for (int i = 0; i < 2; ++i) {  // the first answers "late" is taken while this one waits; then the span is free
    absl::StatusOr<std::string> next = client.Call(2, std::string(800000, 'c'), In(milliseconds(20000)));
    ASSERT_TRUE(next.ok()) << next.status();
  }
  EXPECT_EQ(in_region.load(), 2);
}

// What the callee refuses of a region: one it cannot map (empty), a span outside it, a payload
// in a region never offered, a second region, a span over the callee's limit. Each closes the
// pipe before any handler runs.
TEST(CallPipeTest, ASpanTheRegionDoesNotHoldClosesThePipe) {
  auto memfd_of = [](size_t bytes) {
    const int fd = memfd_create("test-region", MFD_CLOEXEC);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    return fd;
  };
  struct Case {
    const char* what;
    bool offer_region;
    bool offer_twice;
    uint64_t offset, bytes;
  };
  for (const Case& c : {Case{"an empty region", true, false, 0, 0}, Case{"past the end", true, false, 4000, 200},
                        Case{"offset past the end", true, false, 5000, 0},
                        Case{"no region offered", false, false, 0, 100}, Case{"a second region", true, true, 0, 100},
                        Case{"over the limit", true, false, 0, 2000}}) {
    Pair pair;
    CountingCallee callee(pair.fds[1], Nothing, 1000);
    for (int i = 0; i < (c.offer_region ? (c.offer_twice ? 2 : 1) : 0); ++i) {
      CallFrame offer;
      offer.kind = CallFrameKind::kRegion;
      offer.passed_fd = memfd_of(std::string(c.what) == "an empty region" ? 0 : 4096);  // empty: nothing to map
      ASSERT_TRUE(WriteCallFrame(pair.fds[0], offer).ok());
      close(offer.passed_fd);
    }
    CallFrame call;
    call.kind = CallFrameKind::kCall;
    call.method = 1;
    call.call_id = 1;
    call.payload_in_region = true;
    call.region_offset = c.offset;
    call.region_bytes = c.bytes;
    // An empty region closes the pipe at its offer: the call's write may then find it closed.
    const bool closes_at_offer = std::string(c.what) == "an empty region";
    if (!c.offer_twice) {
      const bool sent = WriteCallFrame(pair.fds[0], call).ok();
      if (!closes_at_offer) {
        ASSERT_TRUE(sent) << c.what;
      }
    }
    char byte;
    EXPECT_EQ(read(pair.fds[0], &byte, 1), 0) << c.what;  // the callee closed its end
    EXPECT_EQ(callee.calls.load(), 0) << c.what;
    close(pair.fds[0]);
  }
}

// A region's descriptor travels with its frame; one sent with any other frame is dropped; a
// payload in the region is a 16-byte span on the wire, read back as a span.
TEST(CallPipeTest, ARegionsDescriptorTravelsWithItsFrame) {
  Pair pair;
  const int memfd = memfd_create("test-region", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  CallFrame offer;
  offer.kind = CallFrameKind::kRegion;
  offer.passed_fd = memfd;
  ASSERT_TRUE(WriteCallFrame(pair.fds[0], offer).ok());
  CallFrame stray;
  stray.kind = CallFrameKind::kCancel;
  stray.call_id = 5;
  stray.passed_fd = memfd;
  ASSERT_TRUE(WriteCallFrame(pair.fds[0], stray).ok());
  CallFrame call;
  call.kind = CallFrameKind::kCall;
  call.call_id = 6;
  call.payload_in_region = true;
  call.region_offset = 128;
  call.region_bytes = 70000;
  ASSERT_TRUE(WriteCallFrame(pair.fds[0], call).ok());
  absl::StatusOr<CallFrame> read_offer = ReadCallFrame(pair.fds[1], 1 << 20);
  ASSERT_TRUE(read_offer.ok()) << read_offer.status();
  EXPECT_EQ(read_offer->kind, CallFrameKind::kRegion);
  ASSERT_GE(read_offer->passed_fd, 0);
  struct stat sent_st, got_st;
  ASSERT_EQ(fstat(memfd, &sent_st), 0);
  ASSERT_EQ(fstat(read_offer->passed_fd, &got_st), 0);
  EXPECT_EQ(sent_st.st_ino, got_st.st_ino);
  close(read_offer->passed_fd);
  absl::StatusOr<CallFrame> read_stray = ReadCallFrame(pair.fds[1], 1 << 20);
  ASSERT_TRUE(read_stray.ok()) << read_stray.status();
  EXPECT_EQ(read_stray->passed_fd, -1);
  absl::StatusOr<CallFrame> read_call = ReadCallFrame(pair.fds[1], 1 << 20);
  ASSERT_TRUE(read_call.ok()) << read_call.status();
  EXPECT_TRUE(read_call->payload_in_region);
  EXPECT_EQ(read_call->region_offset, 128u);
  EXPECT_EQ(read_call->region_bytes, 70000u);
  EXPECT_TRUE(read_call->payload.empty());
  // The span's size is held to the reader's limit, as an inline payload's is.
  ASSERT_TRUE(WriteCallFrame(pair.fds[0], call).ok());
  EXPECT_EQ(ReadCallFrame(pair.fds[1], 1000).status().code(), absl::StatusCode::kResourceExhausted);
  close(memfd);
  close(pair.fds[0]);
  close(pair.fds[1]);
}

// A tail staged ahead of its call lies in the region already: the call copies only its own
// bytes in front of it and the callee reads one payload. A staged tail the call cannot use
// (front too small, already taken, another client's) leaves the call to copy everything; one
// dropped untaken frees its span.
TEST(CallPipeTest, AStagedTailIsSentWithoutCopyingItAgain) {
  Pair pair;
  CountingCallee callee(pair.fds[1], [](absl::string_view payload) { return std::string(payload); });
  CallPipeClient client(pair.fds[0], "test", 4 << 20, /*region_bytes=*/1 << 20);
  const std::string a(300000, 'a'), b(100000, 'b');
  std::shared_ptr<const StagedTail> staged = client.Stage(64, {a, b});
  ASSERT_NE(staged, nullptr);
  absl::StatusOr<std::string> answer = client.Call(1, "head:", In(milliseconds(20000)), {a, b}, staged.get());
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, "head:" + a + b);
  // Taken once: a second call with it copies its whole payload afresh (and still reads right).
  answer = client.Call(1, "again:", In(milliseconds(20000)), {a, b}, staged.get());
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, "again:" + a + b);
  // A payload longer than the room in front goes the ordinary way; the span is freed once the
  // staged tail is dropped.
  std::shared_ptr<const StagedTail> narrow = client.Stage(4, {a});
  ASSERT_NE(narrow, nullptr);
  answer = client.Call(1, "too long a head:", In(milliseconds(20000)), {a}, narrow.get());
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, "too long a head:" + a);
  EXPECT_EQ(client.Stage(0, {std::string(800000, 'c')}), nullptr) << "the narrow tail's span is still held";
  narrow.reset();
  EXPECT_NE(client.Stage(0, {std::string(800000, 'c')}), nullptr) << "freed when the tail was dropped";
  // Another client's staged tail is not this one's to take.
  Pair other_pair;
  CallPipeClient other(other_pair.fds[0], "other", 4 << 20, /*region_bytes=*/1 << 20);
  std::shared_ptr<const StagedTail> foreign = other.Stage(64, {a});
  ASSERT_NE(foreign, nullptr);
  answer = client.Call(1, "mine:", In(milliseconds(20000)), {a}, foreign.get());
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, "mine:" + a);
  EXPECT_EQ(callee.in_region.load(), 4);
  // Nothing to stage without a region, or for a tail small enough to go inline.
  Pair plain_pair;
  CallPipeClient plain(plain_pair.fds[0], "plain");
  EXPECT_EQ(plain.Stage(64, {a}), nullptr);
  EXPECT_EQ(client.Stage(64, {"small"}), nullptr);
}

// A worker's call pipe that cannot be made (no descriptor left) fails the start, naming what
// failed, and starts no child. The binary exists (this test's own), so the start gets as far
// as the pipe.
TEST(CallPipeTest, AStartWhosePipeCannotBeMadeFails) {
  absl::StatusOr<ChildServer> child = absl::UnknownError("not started");
  WithNoDescriptorLeft([&] { child = ChildServer::Start("/proc/self/exe", {}, 5, /*call_pipe=*/true); });
  ASSERT_FALSE(child.ok());
  EXPECT_NE(child.status().message().find("socketpair for a child's call pipe"), std::string::npos) << child.status();
}

}  // namespace
}  // namespace lorastep
