#include "rpc/poller_warmth.h"

#include <grpcpp/alarm.h>

namespace lorastep {

PollerWarmth::PollerWarmth(std::chrono::microseconds window, std::chrono::microseconds period)
    : window_(window), period_(period) {}

PollerWarmth::~PollerWarmth() {
  grpc::Alarm* armed = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // no alarm is set from here on
    if (armed_) armed = alarms_[next_ ^ 1].get();
  }
  // Outside the lock: a cancelled alarm's callback may run on this thread.
  if (armed != nullptr) armed->Cancel();
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return !armed_; });
  lock.unlock();
  for (auto& alarm : alarms_) alarm.reset();  // none armed: their callbacks have returned
}

void PollerWarmth::Answered() {
  if (window_.count() <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  until_ = std::chrono::steady_clock::now() + window_;
  if (!armed_ && !stopping_) ArmLocked();
}

int64_t PollerWarmth::ticks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ticks_;
}

void PollerWarmth::ArmLocked() {
  // Alarms take turns: the one whose callback is running is not set again from inside it.
  std::unique_ptr<grpc::Alarm>& alarm = alarms_[next_];
  next_ ^= 1;
  alarm = std::make_unique<grpc::Alarm>();
  armed_ = true;
  alarm->Set(std::chrono::system_clock::now() + period_, [this](bool ok) { Fired(ok); });
}

void PollerWarmth::Fired(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  ++ticks_;
  if (ok && !stopping_ && std::chrono::steady_clock::now() < until_) {
    ArmLocked();
  } else {
    idle_.notify_all();
  }
}

}  // namespace lorastep
