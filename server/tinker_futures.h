// The futures of the Tinker-compatible front: a submitted call answers at once with a
// request id, and the client asks for its result with retrieve_future until it is there. A
// retrieve of a pending future is held (a long poll) until the result comes or the poll
// window passes, then answered "try_again"; a held poll costs no thread. Finished futures are
// kept for a while (`keep_done`) so a retrieve repeated after a lost answer gets the same
// answer; each owner holds at most `max_per_owner` (the oldest finished ones go first).
// No HTTP here: answers are handed to a callback.
#ifndef LORASTEP_SERVER_TINKER_FUTURES_H_
#define LORASTEP_SERVER_TINKER_FUTURES_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace lorastep {

// One HTTP answer, as the front gives it to its server (server/http_front_server.h).
struct HttpAnswer {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};
using HttpReply = std::function<void(HttpAnswer)>;

// 200 JSON answers.
HttpAnswer JsonAnswer(const std::string& json_text, int status = 200);
// A refusal: its HTTP status (tinker_wire.h's HttpStatusOf) and {"detail": message}.
HttpAnswer ErrorAnswer(const absl::Status& status);

struct TinkerFutureOptions {
  std::chrono::milliseconds poll_window{30000};      // a held retrieve answers try_again after it
  std::chrono::milliseconds keep_done{15 * 60 * 1000};  // finished futures kept this long
  size_t max_per_owner = 4096;  // futures one owner holds, pending or finished (--tinker_max_futures_per_key)
};

class TinkerFutures {
 public:
  explicit TinkerFutures(TinkerFutureOptions options);
  ~TinkerFutures();  // answers every held retrieve try_again

  // A new pending future of `owner`; its request id. RESOURCE_EXHAUSTED naming
  // --tinker_max_futures_per_key when the owner holds `max_per_owner` pending ones.
  absl::StatusOr<std::string> Create(const std::string& owner);
  // Finishes the future with `answer` (its result, or a failure shape), waking its polls.
  void Finish(const std::string& id, HttpAnswer answer);
  // Answers the retrieve of `id` by `owner`: at once when finished (or unknown: 404, also for
  // another owner's id), else when it finishes or the poll window passes (try_again).
  void Retrieve(const std::string& owner, const std::string& id, HttpReply reply);

  size_t held_polls();  // retrieves waiting now
  // Answers every held retrieve try_again now (the server is stopping).
  void AnswerHeldPolls();

 private:
  struct HeldPoll {
    std::chrono::steady_clock::time_point until;
    std::string id;
    HttpReply reply;  // null once answered
  };
  struct Future {
    std::string owner;
    bool done = false;
    HttpAnswer answer;
    std::chrono::steady_clock::time_point done_at;
    std::vector<std::shared_ptr<HeldPoll>> polls;
  };
  void Housekeep();  // the one thread: ends polls whose window passed, forgets old futures
  void ForgetOldest(const std::string& owner);  // under mu_

  const TinkerFutureOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  uint64_t next_ = 1;
  std::string id_salt_;  // random per process: ids of a restarted front are new
  std::map<std::string, Future> futures_;
  std::map<std::string, std::deque<std::string>> by_owner_;  // ids in creation order
  std::deque<std::shared_ptr<HeldPoll>> held_;                // in arrival order = expiry order
  std::thread housekeeper_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_FUTURES_H_
