// Runs submitted closures one at a time, in order, on its own thread. gRPC handlers hand
// their work to one and return at once, so no gRPC thread blocks on training work.
#ifndef LORASTEP_RPC_SERIAL_EXECUTOR_H_
#define LORASTEP_RPC_SERIAL_EXECUTOR_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

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

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERIAL_EXECUTOR_H_
