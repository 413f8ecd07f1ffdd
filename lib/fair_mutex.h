// A mutex that admits waiters in arrival order (a ticket lock over a condition variable).
// std::mutex may hand the lock to the same thread again and again; where runs share one
// worker or one mesh, that lets one run's calls starve the others'.
#ifndef LORASTEP_LIB_FAIR_MUTEX_H_
#define LORASTEP_LIB_FAIR_MUTEX_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace lorastep {

class FairMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> guard(mu_);
    const uint64_t ticket = next_ticket_++;
    cv_.wait(guard, [&] { return serving_ == ticket; });
  }
  // Tickets taken and not yet released: the holder plus every waiter.
  uint64_t queued() {
    std::lock_guard<std::mutex> guard(mu_);
    return next_ticket_ - serving_;
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> guard(mu_);
      ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_FAIR_MUTEX_H_
