// --state_ttl_hours: a thread that removes lorastep's state-store folders older than the
// TTL, checking every tenth of it (1 s to 10 min). One per store (rank 0's worker, or the
// coordinator's in-process worker). Stops when destroyed.
#ifndef LORASTEP_LIB_IO_STATE_PRUNER_H_
#define LORASTEP_LIB_IO_STATE_PRUNER_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace lorastep {

class StatePruner {
 public:
  StatePruner(std::string state_dir, int64_t ttl_s);
  ~StatePruner();
  StatePruner(const StatePruner&) = delete;
  StatePruner& operator=(const StatePruner&) = delete;

 private:
  void Loop();

  const std::string state_dir_;
  const int64_t ttl_s_;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_STATE_PRUNER_H_
