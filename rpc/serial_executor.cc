#include "rpc/serial_executor.h"

#include <algorithm>

namespace lorastep {

SerialExecutor::SerialExecutor() : thread_([this] { Loop(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialExecutor::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void SerialExecutor::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

KeyedExecutor::KeyedExecutor(size_t threads) {
  for (size_t i = 0; i < std::max<size_t>(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

KeyedExecutor::~KeyedExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void KeyedExecutor::Submit(const std::string& key, std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& queue = queued_[key];
    // A key takes a turn when it gets work and is neither waiting for a turn nor running.
    if (queue.empty() && !running_[key]) turns_.push_back(key);
    queue.push_back(std::move(task));
  }
  cv_.notify_one();
}

void KeyedExecutor::Loop() {
  for (;;) {
    std::string key;
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !turns_.empty(); });
      if (turns_.empty()) return;  // stopping and drained (running keys requeue themselves)
      key = std::move(turns_.front());
      turns_.pop_front();
      auto& queue = queued_[key];
      task = std::move(queue.front());
      queue.pop_front();
      running_[key] = true;
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_.erase(key);
      auto it = queued_.find(key);
      if (it->second.empty()) {
        queued_.erase(it);
      } else {
        turns_.push_back(key);  // its next task waits behind the other keys' turns
        cv_.notify_one();
      }
    }
  }
}

}  // namespace lorastep
