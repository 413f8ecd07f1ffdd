// One call's cancellation, shared by every wait on its path. The server that received the
// call cancels it (the client went away, its deadline passed, the server shuts down); each
// wait that cancellation must end (a worker call, a pipe call's answer) registers what ends
// it for as long as it waits. Thread-safe.
//
//   auto token = std::make_shared<CancelToken>();
//   CancelToken::Registration on(token.get(), [&] { ctx.TryCancel(); });  // ends the wait
//   ... wait ...                                                          // `on` unregisters
#ifndef LORASTEP_LIB_CANCEL_TOKEN_H_
#define LORASTEP_LIB_CANCEL_TOKEN_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace lorastep {

class CancelToken {
 public:
  // Runs every registered callback once, on this thread; later registrations run at once.
  void Cancel() {
    std::vector<std::function<void()>> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_.exchange(true)) return;
      for (auto& [id, f] : callbacks_) run.push_back(std::move(f));
      callbacks_.clear();
      running_ = true;
    }
    for (auto& f : run) f();
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    done_.notify_all();
  }
  bool cancelled() const { return cancelled_.load(); }

  // While it lives, `on_cancel` runs when the token is cancelled (at once if it already is).
  // Its destructor returns only once the callback has run or can no longer run, so what the
  // callback touches may be destroyed right after.
  class Registration {
   public:
    Registration(CancelToken* token, std::function<void()> on_cancel) : token_(token) {
      if (token_ == nullptr) return;
      {
        std::lock_guard<std::mutex> lock(token_->mu_);
        if (!token_->cancelled_) {
          id_ = ++token_->next_id_;
          token_->callbacks_[id_] = std::move(on_cancel);
          return;
        }
      }
      on_cancel();
    }
    ~Registration() {
      if (token_ == nullptr || id_ == 0) return;
      std::unique_lock<std::mutex> lock(token_->mu_);
      if (token_->callbacks_.erase(id_) > 0) return;
      token_->done_.wait(lock, [this] { return !token_->running_; });  // it is running now
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    CancelToken* token_;
    uint64_t id_ = 0;
  };

 private:
  std::mutex mu_;
  std::condition_variable done_;
  std::atomic<bool> cancelled_{false};
  bool running_ = false;  // Cancel is running the callbacks
  uint64_t next_id_ = 0;
  std::map<uint64_t, std::function<void()>> callbacks_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_CANCEL_TOKEN_H_
