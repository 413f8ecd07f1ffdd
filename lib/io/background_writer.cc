#include "lib/io/background_writer.h"

#include <utility>

namespace lorastep {

BackgroundWriter::BackgroundWriter() : thread_([this] { Loop(); }) {}

BackgroundWriter::~BackgroundWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BackgroundWriter::Submit(const std::string& key, std::function<absl::Status()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t serial = next_serial_++;
    outcomes_[key] = Outcome{serial, std::nullopt};
    queue_.push_back(Job{key, serial, std::move(job)});
  }
  cv_.notify_all();
}

std::optional<absl::Status> BackgroundWriter::Await(const std::string& key) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = outcomes_.end();
  // A later job under the key replaces the outcome with an unfinished one: waited for too.
  cv_.wait(lock, [&] {
    it = outcomes_.find(key);
    return it == outcomes_.end() || it->second.status.has_value();
  });
  if (it == outcomes_.end()) return std::nullopt;
  return it->second.status;
}

size_t BackgroundWriter::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + running_;
}

void BackgroundWriter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every job ran
    Job job = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    absl::Status status = job.run();
    job.run = nullptr;  // frees what the job held (a snapshot) before the next one
    lock.lock();
    --running_;
    auto it = outcomes_.find(job.key);
    if (it != outcomes_.end() && it->second.serial == job.serial) {
      it->second.status = std::move(status);
      finished_order_.emplace_back(job.key, job.serial);
      while (finished_order_.size() > kKeptOutcomes) {
        auto old = outcomes_.find(finished_order_.front().first);
        if (old != outcomes_.end() && old->second.serial == finished_order_.front().second) outcomes_.erase(old);
        finished_order_.pop_front();
      }
    }
    cv_.notify_all();
  }
}

}  // namespace lorastep
