// KeyedExecutor: one key's tasks in order and never two at once; keys with work take turns.
// Both executors with spinning on.
#include <pthread.h>
#include <time.h>

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "lib/io/background_writer.h"
#include "lib/prometheus_registry.h"
#include "rpc/poller_warmth.h"
#include "rpc/serial_executor.h"
#include "rpc/step_metrics.h"
#include "lib/fair_mutex.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

TEST(KeyedExecutorTest, KeysTakeTurnsAndEachKeysTasksStayInOrder) {
  std::mutex mu;
  std::vector<std::string> ran;
  {
    KeyedExecutor ex(1);
    std::promise<void> release;
    std::shared_future<void> released = release.get_future().share();
    ex.Submit("block", [released] { released.wait(); });
    for (int i = 0; i < 4; ++i) {
      ex.Submit("a", [&, i] { std::lock_guard<std::mutex> l(mu); ran.push_back("a" + std::to_string(i)); });
    }
    ex.Submit("b", [&] { std::lock_guard<std::mutex> l(mu); ran.push_back("b0"); });
    ex.Submit("b", [&] { std::lock_guard<std::mutex> l(mu); ran.push_back("b1"); });
    release.set_value();
  }  // the destructor drains
  // Not a0 a1 a2 a3 b0 b1 (what one FIFO per hashed executor does): the runs alternate.
  EXPECT_EQ(ran, (std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "a3"}));
}

// Issue 55: with a group per key (a run's tenant), groups take turns before keys: tenant
// "b"'s one run is served after one task of tenant "a", however many runs "a" has waiting.
TEST(KeyedExecutorTest, GroupsTakeTurnsBeforeTheirKeys) {
  std::mutex mu;
  std::vector<std::string> ran;
  {
    KeyedExecutor ex(1, std::chrono::microseconds(0), [](const std::string& key) { return key.substr(0, 1); });
    std::promise<void> release;
    std::shared_future<void> released = release.get_future().share();
    ex.Submit("block", [released] { released.wait(); });
    for (const char* key : {"a1", "a2", "a3", "a4", "b1"}) {
      ex.Submit(key, [&, key] { std::lock_guard<std::mutex> l(mu); ran.push_back(key); });
    }
    release.set_value();
  }
  // Without groups: a1 a2 a3 a4 b1.
  EXPECT_EQ(ran, (std::vector<std::string>{"a1", "b1", "a2", "a3", "a4"}));
}

// Issue 55: once a second group has been seen, one group holds at most all but an eighth of
// the threads, so a tenant whose runs all wait on the device leaves a thread for another
// tenant's call; with one group only, every thread serves it.
TEST(KeyedExecutorTest, OneGroupLeavesAThreadForAnother) {
  auto group_of = [](const std::string& key) { return key.substr(0, 1); };
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> started{0};
  {
    KeyedExecutor alone(8, std::chrono::microseconds(0), group_of);
    std::promise<void> release_alone;
    std::shared_future<void> alone_released = release_alone.get_future().share();
    std::atomic<int> alone_started{0};
    for (int i = 0; i < 8; ++i) {
      alone.Submit("a" + std::to_string(i), [&, alone_released] {
        ++alone_started;
        alone_released.wait();
      });
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (alone_started < 8 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    EXPECT_EQ(alone_started, 8) << "one group alone takes every thread";
    release_alone.set_value();
  }
  KeyedExecutor ex(8, std::chrono::microseconds(0), group_of);
  std::promise<void> b0_done;
  ex.Submit("b0", [&] { b0_done.set_value(); });
  b0_done.get_future().wait();
  for (int i = 0; i < 8; ++i) {
    ex.Submit("a" + std::to_string(i), [&, released] {
      ++started;
      released.wait();
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (started < 7 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  std::promise<void> b1_done;
  ex.Submit("b1", [&] { b1_done.set_value(); });
  // b1 runs while seven a tasks hold their threads; the eighth waits for one of them.
  EXPECT_EQ(b1_done.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(started, 7) << "the eighth a task waits for one of its group's threads";
  release.set_value();
}

TEST(KeyedExecutorTest, OneKeyNeverRunsTwiceAtOnce) {
  std::atomic<int> inside{0}, most{0}, done{0};
  {
    KeyedExecutor ex(4);
    for (int i = 0; i < 50; ++i) {
      ex.Submit(i % 2 ? "x" : "y", [&] {
        const int n = ++inside;  // at most one x and one y at a time
        int m = most.load();
        while (n > m && !most.compare_exchange_weak(m, n)) {}
        // Held until another task is inside (a second x would show as three), or briefly.
        testing::WaitFor([&] { return inside.load() >= 2; }, std::chrono::milliseconds(5), std::chrono::milliseconds(0));
        --inside;
        ++done;
      });
    }
  }
  EXPECT_EQ(done, 50);
  EXPECT_LE(most, 2);
}

// Work wakes the most recently idle thread: a caller sending one call after another lands
// on one thread of a pool of 8 (the pool's per-thread CUDA setup is paid once, not per
// thread), while calls of different keys sent at once still run side by side.
TEST(KeyedExecutorTest, SteadyCallsLandOnOneWarmThread) {
  KeyedExecutor ex(8);
  ASSERT_TRUE(testing::WaitFor([&] { return ex.IdleThreads() == 8; }));  // every thread has started
  std::vector<std::thread::id> ran_on;
  for (int i = 0; i < 6; ++i) {
    std::promise<std::thread::id> where;
    ex.Submit("run", [&] { where.set_value(std::this_thread::get_id()); });
    ran_on.push_back(where.get_future().get());
    ASSERT_TRUE(testing::WaitFor([&] { return ex.IdleThreads() == 8; }));  // the thread is idle again
  }
  for (const auto& id : ran_on) EXPECT_EQ(id, ran_on.front());
  std::atomic<int> inside{0}, most{0};
  std::vector<std::promise<void>> finished(4);
  for (int k = 0; k < 4; ++k) {
    ex.Submit("run" + std::to_string(k), [&, k] {
      const int n = ++inside;
      int m = most.load();
      while (n > m && !most.compare_exchange_weak(m, n)) {}
      testing::WaitFor([&] { return inside.load() == 4; }, std::chrono::seconds(10));  // side by side, or not at all
      --inside;
      finished[k].set_value();
    });
  }
  for (auto& f : finished) f.get_future().wait();
  EXPECT_EQ(most, 4);
}

// With spinning on, a call that comes while the thread polls, or after it gave up and
// slept, runs once and in order.
TEST(ExecutorSpinTest, CallsDuringAndAfterTheSpinRunInOrder) {
  for (const auto spin : {std::chrono::microseconds(0), std::chrono::microseconds(5000)}) {
    std::mutex mu;
    std::vector<int> serial, keyed;
    {
      SerialExecutor ex(spin);
      KeyedExecutor kx(2, spin);
      for (int i = 0; i < 12; ++i) {
        ex.Submit([&, i] { std::lock_guard<std::mutex> l(mu); serial.push_back(i); });
        kx.Submit("run", [&, i] { std::lock_guard<std::mutex> l(mu); keyed.push_back(i); });
        // Inside the spin (1 ms), after it (8 ms), or at once: when a call comes is the subject.
        std::this_thread::sleep_for(std::chrono::milliseconds(i % 3 == 0 ? 1 : i % 3 == 1 ? 8 : 0));
      }
    }
    std::vector<int> expected(12);
    for (int i = 0; i < 12; ++i) expected[i] = i;
    EXPECT_EQ(serial, expected) << spin.count();
    EXPECT_EQ(keyed, expected) << spin.count();
  }
}

// Eight keys' tasks that end together leave one thread spinning, not eight: over the next
// 200 ms (inside the ten-minute spin) one pool thread uses CPU time and the others sleep. Then the
// next task lands on the thread that spun, and two tasks sent at once run side by side (the
// polling thread takes one, a sleeping thread is woken for the other).
TEST(ExecutorSpinTest, OneThreadSpinsAtATime) {
  const int keys = 8;
  auto ex = std::make_unique<KeyedExecutor>(keys, std::chrono::minutes(10));
  std::mutex mu;
  std::vector<clockid_t> clocks;
  std::vector<std::thread::id> ids;
  std::atomic<int> started{0};
  std::vector<std::promise<void>> finished(keys);
  for (int k = 0; k < keys; ++k) {
    ex->Submit("run" + std::to_string(k), [&, k] {
      clockid_t clock;
      ASSERT_EQ(pthread_getcpuclockid(pthread_self(), &clock), 0);
      {
        std::lock_guard<std::mutex> lock(mu);
        clocks.push_back(clock);
        ids.push_back(std::this_thread::get_id());
      }
      ++started;
      while (started.load() < keys) std::this_thread::yield();  // all eight run side by side, then end together
      finished[k].set_value();
    });
  }
  for (auto& f : finished) f.get_future().wait();
  auto cpu_ms = [](clockid_t clock) {
    timespec t{};
    clock_gettime(clock, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
  };
  // Each thread spins or sleeps by now: all but the spinner wait for work.
  ASSERT_TRUE(testing::WaitFor([&] { return ex->IdleThreads() == keys - 1; }));
  std::vector<double> before;
  for (clockid_t clock : clocks) before.push_back(cpu_ms(clock));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the CPU each thread uses in 200 ms is the figure
  int busy = 0;
  std::optional<std::thread::id> spinner;
  for (size_t i = 0; i < clocks.size(); ++i) {
    if (cpu_ms(clocks[i]) - before[i] > 20.0) ++busy, spinner = ids[i];
  }
  EXPECT_LE(busy, 1) << "threads that used more than 20 ms of CPU in 200 ms";
  std::promise<std::thread::id> next;
  ex->Submit("run0", [&] { next.set_value(std::this_thread::get_id()); });
  const std::thread::id ran_on = next.get_future().get();
  if (spinner) {
    EXPECT_EQ(ran_on, *spinner) << "the spinning thread takes the next task";
  }
  // Two tasks that can only finish together: one goes to the thread that polls (it ran run0
  // and polls again), the other wakes a sleeping thread.
  std::atomic<int> together{0};
  std::vector<std::promise<bool>> both(2);  // whether the task saw the other one running
  for (int k = 0; k < 2; ++k) {
    ex->Submit("run" + std::to_string(k + 1), [&, k] {
      ++together;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (together.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      both[k].set_value(together.load() == 2);
    });
  }
  for (auto& b : both) EXPECT_TRUE(b.get_future().get()) << "the two tasks ran one after the other";
  // The destructor ends the polling thread's spin instead of waiting it out (ten minutes).
  ASSERT_TRUE(testing::WaitFor([&] { return ex->IdleThreads() == keys - 1; }));  // a thread polls again
  EXPECT_TRUE(testing::ReturnsWithin([&] { ex.reset(); }));
}

// Bookkeeping after the answer: deferred work runs when the answering thread leaves its scope,
// in order; outside a scope at once; a nested scope runs its own.
TEST(AfterAnswerTest, DeferredWorkRunsWhenTheScopeEndsInOrder) {
  std::vector<int> ran;
  RunAfterAnswer([&] { ran.push_back(0); });
  EXPECT_EQ(ran, std::vector<int>{0});
  {
    AfterAnswerScope scope;
    RunAfterAnswer([&] { ran.push_back(1); });
    {
      AfterAnswerScope inner;
      RunAfterAnswer([&] { ran.push_back(2); });
    }
    EXPECT_EQ(ran, (std::vector<int>{0, 2}));
    RunAfterAnswer([&] { ran.push_back(3); });
    std::thread other([&] { RunAfterAnswer([&] { ran.push_back(4); }); });  // no scope there: at once
    other.join();
    EXPECT_EQ(ran, (std::vector<int>{0, 2, 4}));
  }
  EXPECT_EQ(ran, (std::vector<int>{0, 2, 4, 1, 3}));
  // A step's figures recorded inside a scope reach the registry when it ends.
  PrometheusRegistry registry;
  DeclareStepMetrics(&registry);
  google::protobuf::Map<std::string, double> metrics;
  metrics["loss:sum"] = 0.5;
  metrics["co_scheduled_missed_runs:max"] = 2;
  metrics["time_coschedule_last_arrival_s:sum"] = 0.004;
  {
    AfterAnswerScope scope;
    RecordStepMetrics(&registry, "r", "train_step", metrics, 7);
    EXPECT_EQ(registry.Render().find("lorastep_loss{run=\"r\"}"), std::string::npos);
  }
  const std::string rendered = registry.Render();
  EXPECT_NE(rendered.find("lorastep_loss{run=\"r\"} 0.5"), std::string::npos) << rendered;
  EXPECT_NE(rendered.find("lorastep_co_scheduled_missed_runs{run=\"r\"} 2"), std::string::npos) << rendered;
  EXPECT_NE(rendered.find("phase=\"coschedule_last_arrival\""), std::string::npos) << rendered;
}

TEST(FairMutexTest, WaitersAreAdmittedInArrivalOrder) {
  FairMutex m;
  std::vector<int> order;
  m.lock();
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      std::lock_guard<FairMutex> l(m);
      order.push_back(i);
    });
    // Thread i holds its ticket before thread i + 1 starts (a fixed sleep was not enough on a
    // loaded 2-core machine: CI saw {1, 2, 3, 0}).
    ASSERT_TRUE(testing::WaitFor([&] { return m.queued() >= static_cast<uint64_t>(i) + 2; }));
  }
  m.unlock();
  for (auto& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

// BackgroundWriter: jobs run in order on its thread; Await returns how the latest job under
// a key ended, waiting for it; the destructor finishes queued jobs.
TEST(BackgroundWriterTest, AwaitWaitsForTheLatestJobUnderAKey) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::vector<std::string> ran;
  std::mutex mu;
  auto note = [&](const std::string& what) {
    std::lock_guard<std::mutex> l(mu);
    ran.push_back(what);
  };
  {
    BackgroundWriter writer;
    EXPECT_FALSE(writer.Await("never").has_value());
    writer.Submit("a", [&] {
      released.wait();
      note("a1");
      return absl::OkStatus();
    });
    writer.Submit("b", [&] {
      note("b");
      return absl::ResourceExhaustedError("disk full");
    });
    writer.Submit("a", [&] {
      note("a2");
      return absl::DataLossError("second");
    });
    EXPECT_EQ(writer.pending(), 3u);
    auto waiting = std::async(std::launch::async, [&] { return writer.Await("a"); });
    EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
    release.set_value();
    const std::optional<absl::Status> a = waiting.get();
    ASSERT_TRUE(a.has_value());
    EXPECT_TRUE(absl::IsDataLoss(*a)) << *a;  // the latest job under "a", not the first
    const std::optional<absl::Status> b = writer.Await("b");
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(absl::IsResourceExhausted(*b)) << *b;
    EXPECT_EQ(writer.pending(), 0u);
    std::promise<void> gate;
    std::shared_future<void> opened = gate.get_future().share();
    writer.Submit("blocker", [opened] {
      opened.wait();
      return absl::OkStatus();
    });
    writer.Submit("c", [&] {
      note("c");
      return absl::OkStatus();
    });
    gate.set_value();
  }  // the destructor finishes "c" (queued behind the blocker until just now)
  EXPECT_EQ(ran, (std::vector<std::string>{"a1", "b", "a2", "c"}));
}

TEST(BackgroundWriterTest, OutcomesAreForgottenBeyondTheBound) {
  BackgroundWriter writer;
  for (size_t i = 0; i <= BackgroundWriter::kKeptOutcomes; ++i) {
    writer.Submit("k" + std::to_string(i), [] { return absl::OkStatus(); });
  }
  const auto last = writer.Await("k" + std::to_string(BackgroundWriter::kKeptOutcomes));
  ASSERT_TRUE(last.has_value());
  EXPECT_TRUE(last->ok());
  EXPECT_FALSE(writer.Await("k0").has_value());  // the oldest outcome went
  EXPECT_TRUE(writer.Await("k1").has_value());
}

}  // namespace
// PollerWarmth: after an answer, alarms fire until its window has passed, and stop; a later
// answer starts them again; a zero window sets none; it can go while they run.
TEST(PollerWarmthTest, AlarmsFireForTheWindowAfterEachAnswer) {
  PollerWarmth off(std::chrono::microseconds(0));
  off.Answered();
  PollerWarmth warmth(std::chrono::milliseconds(10), std::chrono::microseconds(200));
  warmth.Answered();
  // Windows are the subject: both pass (the zero one sets no alarm, the 10 ms one fires and stops).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(off.ticks(), 0);
  const int64_t first = warmth.ticks();
  EXPECT_GE(first, 3);   // 50 at most in 10 ms; a loaded machine fires fewer
  EXPECT_LE(first, 60);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // no alarm comes after the window: time must pass
  EXPECT_EQ(warmth.ticks(), first);  // stopped after the window
  warmth.Answered();
  EXPECT_TRUE(testing::WaitFor([&] { return warmth.ticks() > first; }));
  // Destroyed while its alarms run, it ends them instead of waiting out its window (ten minutes).
  auto going = std::make_unique<PollerWarmth>(std::chrono::minutes(10), std::chrono::microseconds(100));
  going->Answered();
  ASSERT_TRUE(testing::WaitFor([&] { return going->ticks() > 0; }));  // its alarms run
  EXPECT_TRUE(testing::ReturnsWithin([&] { going.reset(); }));
}

}  // namespace lorastep
