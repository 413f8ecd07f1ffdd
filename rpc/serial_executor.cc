#include "rpc/serial_executor.h"

#include <algorithm>

namespace lorastep {

void SpinForWork(const std::atomic<uint64_t>& submitted, uint64_t seen, std::chrono::microseconds spin) {
  if (spin.count() <= 0) return;
  const auto until = std::chrono::steady_clock::now() + spin;
  while (submitted.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

SerialExecutor::SerialExecutor(std::chrono::microseconds spin) : spin_(spin), thread_([this] { Loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    submitted_.fetch_add(1, std::memory_order_release);  // ends a spin at once
  }
  cv_.notify_all();
  thread_.join();
}

void SerialExecutor::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    submitted_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

void SerialExecutor::Loop() {
  bool ran = false;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (ran && tasks_.empty() && !stopping_) {
        const uint64_t seen = submitted_.load(std::memory_order_relaxed);
        lock.unlock();
        SpinForWork(submitted_, seen, spin_);
        lock.lock();
      }
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
    ran = true;
  }
}

KeyedExecutor::KeyedExecutor(size_t threads, std::chrono::microseconds spin,
                             std::function<std::string(const std::string&)> group_of)
    : spin_(spin),
      group_of_(std::move(group_of)),
      max_per_group_(std::max<size_t>(1, std::max<size_t>(1, threads) - std::max<size_t>(1, threads) / 8)) {
  for (size_t i = 0; i < std::max<size_t>(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

KeyedExecutor::~KeyedExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    submitted_.fetch_add(1, std::memory_order_release);  // ends a spin at once
    for (Idle* thread : idle_) thread->cv.notify_one();
  }
  for (auto& t : threads_) t.join();
}

void KeyedExecutor::Submit(const std::string& key, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& queue = queued_[key];
    // A key takes a turn when it gets work and is neither waiting for a turn nor running.
    if (queue.empty() && !running_[key]) AddTurn(key);
    queue.push_back(std::move(task));
    submitted_.fetch_add(1, std::memory_order_release);
    if (spinner_free_) {
      spinner_free_ = false;  // the spinning thread takes it
    } else {
      WakeOne();
    }
  }
}

void KeyedExecutor::WakeOne() {
  if (idle_.empty()) return;
  Idle* thread = idle_.back();  // the most recently idle: its caches and CUDA state are warm
  idle_.pop_back();
  thread->woken = true;
  thread->cv.notify_one();
}

void KeyedExecutor::AddTurn(const std::string& key) {
  const std::string group = GroupOf(key);
  if (groups_seen_.size() < 2) groups_seen_.insert(group);
  auto& keys = turns_[group];
  if (keys.empty()) group_turns_.push_back(group);
  keys.push_back(key);
}

bool KeyedExecutor::HasTurn() const {
  if (groups_seen_.size() < 2) return !group_turns_.empty();
  for (const std::string& group : group_turns_) {
    auto running = group_running_.find(group);
    if (running == group_running_.end() || running->second < max_per_group_) return true;
  }
  return false;
}

bool KeyedExecutor::TakeTurn(std::string* key) {
  for (auto g = group_turns_.begin(); g != group_turns_.end(); ++g) {
    if (groups_seen_.size() >= 2 && group_running_[*g] >= max_per_group_) continue;
    const std::string group = *g;
    group_turns_.erase(g);
    auto keys = turns_.find(group);
    *key = std::move(keys->second.front());
    keys->second.pop_front();
    if (keys->second.empty()) {
      turns_.erase(keys);
    } else {
      group_turns_.push_back(group);  // its next key waits behind the other groups' turns
    }
    ++group_running_[group];
    return true;
  }
  return false;
}

void KeyedExecutor::Loop() {
  bool ran = false;
  Idle me;
  for (;;) {
    std::string key;
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (ran && !HasTurn() && !stopping_ && spin_.count() > 0 && !spinning_) {
        spinning_ = spinner_free_ = true;
        const uint64_t seen = submitted_.load(std::memory_order_relaxed);
        lock.unlock();
        SpinForWork(submitted_, seen, spin_);
        lock.lock();
        spinning_ = spinner_free_ = false;
      }
      while (!stopping_ && !HasTurn()) {  // idle until Submit or a finished task picks this thread
        me.woken = false;
        idle_.push_back(&me);
        me.cv.wait(lock, [&] { return me.woken || stopping_; });
        if (!me.woken) idle_.erase(std::find(idle_.begin(), idle_.end(), &me));
      }
      // Stopping and drained, or every waiting group at its share: the threads running those
      // groups' tasks take their turns as they finish.
      if (!TakeTurn(&key)) return;
      auto& queue = queued_[key];
      task = std::move(queue.front());
      queue.pop_front();
      running_[key] = true;
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_.erase(key);
      const std::string group = GroupOf(key);
      if (--group_running_[group] == 0) group_running_.erase(group);
      auto it = queued_.find(key);
      if (it->second.empty()) {
        queued_.erase(it);
      } else {
        AddTurn(key);  // its next task waits behind the other keys' turns
      }
      if (HasTurn()) WakeOne();  // this key's next task, or a group that was at its share
    }
    ran = true;
  }
}

namespace {
thread_local std::vector<std::function<void()>>* after_answer = nullptr;  // the innermost scope's
}  // namespace

void RunAfterAnswer(std::function<void()> work) {
  if (after_answer == nullptr) {
    work();
    return;
  }
  after_answer->push_back(std::move(work));
}

AfterAnswerScope::AfterAnswerScope() : outer_(after_answer) { after_answer = &deferred_; }

AfterAnswerScope::~AfterAnswerScope() {
  after_answer = outer_;
  for (auto& work : deferred_) work();
}

}  // namespace lorastep
