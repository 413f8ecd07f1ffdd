// Keeps a gRPC server's polling thread stirring for a while after each answer. A training
// loop sends its next call a millisecond or two after an answer; a poller that has slept
// since the previous request (a whole training step) is woken later on a virtual machine's
// idle CPU than one that ran moments before (bench/host_costs.cc). Alarms set every `period`
// until `window` after the last answer kick the poller each time (a new earliest timer wakes
// it), so its CPU is still warm when the call arrives. The cost is a few microseconds of CPU
// per period inside the window.
#ifndef LORASTEP_RPC_POLLER_WARMTH_H_
#define LORASTEP_RPC_POLLER_WARMTH_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace grpc {
class Alarm;
}

namespace lorastep {

class PollerWarmth {
 public:
  // `window` zero: Answered does nothing.
  PollerWarmth(std::chrono::microseconds window, std::chrono::microseconds period = std::chrono::microseconds(50));
  // Stops the alarms and waits for the last one's callback.
  ~PollerWarmth();
  PollerWarmth(const PollerWarmth&) = delete;
  PollerWarmth& operator=(const PollerWarmth&) = delete;

  // An answer went out: keep the poller stirring until `window` from now.
  void Answered();
  // Alarms that have fired so far (for tests).
  int64_t ticks() const;

 private:
  void ArmLocked();  // under mu_: the next alarm, `period_` from now
  void Fired(bool ok);

  const std::chrono::microseconds window_;
  const std::chrono::microseconds period_;
  mutable std::mutex mu_;
  std::condition_variable idle_;                    // under mu_: no alarm armed
  bool armed_ = false;                              // under mu_
  bool stopping_ = false;                           // under mu_
  std::chrono::steady_clock::time_point until_;     // under mu_
  std::unique_ptr<grpc::Alarm> alarms_[2];          // under mu_: armed in turn (one may be firing)
  int next_ = 0;                                    // under mu_
  int64_t ticks_ = 0;                               // under mu_
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_POLLER_WARMTH_H_
