// Runs submitted closures one at a time, in order, on its own thread. gRPC handlers hand
// their work to one and return at once, so no gRPC thread blocks on training work.
#ifndef LORASTEP_RPC_SERIAL_EXECUTOR_H_
#define LORASTEP_RPC_SERIAL_EXECUTOR_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lorastep {

class SerialExecutor {
 public:
  SerialExecutor();
  // Runs what is queued, then joins.
  ~SerialExecutor();
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Submit(std::function<void()> task);

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

// Tasks grouped by key (a run id) on a pool of threads: one key's tasks run one at a time in
// submission order, and keys with work take turns (round robin), so a busy run cannot starve
// another and runs do not share a fate through a hash of their ids.
class KeyedExecutor {
 public:
  explicit KeyedExecutor(size_t threads);
  ~KeyedExecutor();  // runs what is queued, then joins
  KeyedExecutor(const KeyedExecutor&) = delete;
  KeyedExecutor& operator=(const KeyedExecutor&) = delete;

  void Submit(const std::string& key, std::function<void()> task);

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::deque<std::function<void()>>> queued_;  // keys with work
  std::deque<std::string> turns_;  // keys with work and none running, in turn order
  std::map<std::string, bool> running_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERIAL_EXECUTOR_H_
