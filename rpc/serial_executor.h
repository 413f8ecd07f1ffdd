// Runs submitted closures one at a time, in order, on its own thread. gRPC handlers hand
// their work to one and return at once, so no gRPC thread blocks on training work.
#ifndef LORASTEP_RPC_SERIAL_EXECUTOR_H_
#define LORASTEP_RPC_SERIAL_EXECUTOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace lorastep {

// Spinning: after a task, an idle thread polls for the next one for up to `spin` before it
// sleeps. A client that sends its next call as soon as it has the answer (a training loop)
// then finds the thread awake instead of paying a wake-up, which on a busy host costs more
// than the poll. The cost is at most `spin` of one core per task.
class SerialExecutor {
 public:
  explicit SerialExecutor(std::chrono::microseconds spin = std::chrono::microseconds(0));
  // Runs what is queued, then joins.
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Submit(std::function<void()> task);

 private:
  void Loop();
  const std::chrono::microseconds spin_;
  std::atomic<uint64_t> submitted_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

// Bookkeeping a call's answer need not wait for (Prometheus updates, the call's log line): on
// a thread inside an AfterAnswerScope (one that answers a call, then leaves the scope) it runs
// when the scope ends, after the answer has gone, in the order deferred; elsewhere at once.
// No other thread is woken for it.
void RunAfterAnswer(std::function<void()> work);
class AfterAnswerScope {
 public:
  AfterAnswerScope();
  ~AfterAnswerScope();  // runs what was deferred inside it
  AfterAnswerScope(const AfterAnswerScope&) = delete;
  AfterAnswerScope& operator=(const AfterAnswerScope&) = delete;

 private:
  std::vector<std::function<void()>>* outer_;  // the enclosing scope's (nested scopes run their own)
  std::vector<std::function<void()>> deferred_;
};

// Polls `submitted` until it moves past `seen` or `spin` has passed (see SerialExecutor).
void SpinForWork(const std::atomic<uint64_t>& submitted, uint64_t seen, std::chrono::microseconds spin);

// Tasks grouped by key (a run id) on a pool of threads: one key's tasks run one at a time in
// submission order, and keys with work take turns (round robin), so a busy run cannot starve
// another and runs do not share a fate through a hash of their ids. With `group_of` (a run's
// tenant), groups take turns first and their keys within them, and once a second group has
// been seen no group holds more than all but an eighth of the threads: a tenant with many
// busy runs cannot take every thread (their tasks wait on the device) and leave another
// tenant's call waiting for one. New work wakes the most
// recently idle thread (last in, first out): a steady caller keeps landing on the same warm
// thread, whose per-thread state (CUDA handles and workspaces set up on first use) is ready,
// however many threads the pool has.
//
// Spinning (`spin`): one thread at a time. The thread that finishes a task first while no
// other spins polls for the next submission, which it then takes itself; every other thread
// that runs out of work sleeps at once. A step that answers many runs together would
// otherwise leave as many threads spinning, on the cores their clients need to receive those
// answers and send the next calls (32 runs on a 16-core host: 32 threads x the spin).
class KeyedExecutor {
 public:
  explicit KeyedExecutor(size_t threads, std::chrono::microseconds spin = std::chrono::microseconds(0),
                         std::function<std::string(const std::string&)> group_of = nullptr);
  ~KeyedExecutor();  // runs what is queued, then joins
  KeyedExecutor(const KeyedExecutor&) = delete;
  KeyedExecutor& operator=(const KeyedExecutor&) = delete;

  void Submit(const std::string& key, std::function<void()> task);

  // Threads waiting for work: neither running a task nor spinning.
  size_t IdleThreads() {
    std::lock_guard<std::mutex> lock(mu_);
    return idle_.size();
  }

 private:
  struct Idle {  // a thread waiting for work
    std::condition_variable cv;
    bool woken = false;
  };
  void Loop();
  void WakeOne();  // under mu_
  void AddTurn(const std::string& key);  // under mu_: `key` waits for a turn
  // Under mu_: the next key whose group may take a thread, taken out of the turns; false if none.
  bool TakeTurn(std::string* key);
  bool HasTurn() const;  // under mu_: whether TakeTurn would find one
  std::string GroupOf(const std::string& key) const { return group_of_ ? group_of_(key) : std::string(); }
  const std::chrono::microseconds spin_;
  const std::function<std::string(const std::string&)> group_of_;
  const size_t max_per_group_;  // threads one group may hold once a second group is seen
  std::atomic<uint64_t> submitted_{0};
  std::mutex mu_;
  bool spinning_ = false;      // a thread spins
  bool spinner_free_ = false;  // ... and no submission has claimed it yet
  std::vector<Idle*> idle_;  // waiting threads, the most recently idle last
  std::map<std::string, std::deque<std::function<void()>>> queued_;  // keys with work
  std::map<std::string, std::deque<std::string>> turns_;  // by group: keys with work, none running
  std::deque<std::string> group_turns_;  // groups with keys in turns_, in turn order
  std::map<std::string, bool> running_;
  std::map<std::string, size_t> group_running_;  // tasks running per group
  std::set<std::string> groups_seen_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERIAL_EXECUTOR_H_
