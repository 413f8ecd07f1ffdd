// KeyedExecutor: one key's tasks in order and never two at once; keys with work take turns.
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/serial_executor.h"
#include "lib/fair_mutex.h"

namespace lorastep {
namespace {

TEST(KeyedExecutorTest, KeysTakeTurnsAndEachKeysTasksStayInOrder) {
  std::mutex mu;
  std::vector<std::string> ran;
  {
    KeyedExecutor ex(1);
    std::atomic<bool> release{false};
    ex.Submit("block", [&] { while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
    for (int i = 0; i < 4; ++i) {
      ex.Submit("a", [&, i] { std::lock_guard<std::mutex> l(mu); ran.push_back("a" + std::to_string(i)); });
    }
    ex.Submit("b", [&] { std::lock_guard<std::mutex> l(mu); ran.push_back("b0"); });
    ex.Submit("b", [&] { std::lock_guard<std::mutex> l(mu); ran.push_back("b1"); });
    release = true;
  }  // the destructor drains
  // Not a0 a1 a2 a3 b0 b1 (what one FIFO per hashed executor does): the runs alternate.
  EXPECT_EQ(ran, (std::vector<std::string>{"a0", "b0", "a1", "b1", "a2", "a3"}));
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
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        --inside;
        ++done;
      });
    }
  }
  EXPECT_EQ(done, 50);
  EXPECT_LE(most, 2);
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
    while (m.queued() < static_cast<uint64_t>(i) + 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  m.unlock();
  for (auto& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace lorastep
