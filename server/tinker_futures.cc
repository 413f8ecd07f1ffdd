#include "server/tinker_futures.h"

#include <algorithm>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/tinker_wire.h"

namespace lorastep {

HttpAnswer JsonAnswer(const std::string& json_text, int status) {
  HttpAnswer a;
  a.status = status;
  a.body = json_text;
  return a;
}

HttpAnswer ErrorAnswer(const absl::Status& status) {
  return JsonAnswer(nlohmann::json{{"detail", std::string(status.message())}}.dump(), HttpStatusOf(status));
}

TinkerFutures::TinkerFutures(TinkerFutureOptions options) : options_(options) {
  std::random_device rd;
  id_salt_ = absl::StrFormat("%08x", rd());
  housekeeper_ = std::thread([this] { Housekeep(); });
}

TinkerFutures::~TinkerFutures() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  housekeeper_.join();
}

absl::StatusOr<std::string> TinkerFutures::Create(const std::string& owner) {
  std::lock_guard<std::mutex> lock(mu_);
  std::deque<std::string>& ids = by_owner_[owner];
  if (ids.size() >= options_.max_per_owner) ForgetOldest(owner);
  if (ids.size() >= options_.max_per_owner) {
    return absl::ResourceExhaustedError(absl::StrCat("--tinker_max_futures_per_key: ", options_.max_per_owner,
                                                     " calls of this key are unfinished; retry once some finish"));
  }
  const std::string id = absl::StrCat("req-", id_salt_, "-", next_++);
  futures_[id].owner = owner;
  ids.push_back(id);
  return id;
}

void TinkerFutures::ForgetOldest(const std::string& owner) {
  std::deque<std::string>& ids = by_owner_[owner];
  for (auto it = ids.begin(); it != ids.end(); ++it) {
    auto f = futures_.find(*it);
    if (f != futures_.end() && f->second.done) {
      futures_.erase(f);
      ids.erase(it);
      return;
    }
  }
}

void TinkerFutures::Finish(const std::string& id, HttpAnswer answer) {
  std::vector<HttpReply> replies;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = futures_.find(id);
    if (it == futures_.end() || it->second.done) return;
    Future& f = it->second;
    f.done = true;
    f.done_at = std::chrono::steady_clock::now();
    f.answer = std::move(answer);
    answer = f.answer;
    for (auto& poll : f.polls) {
      if (poll->reply) replies.push_back(std::move(poll->reply));
      poll->reply = nullptr;
    }
    f.polls.clear();
  }
  for (HttpReply& r : replies) r(answer);
}

void TinkerFutures::Retrieve(const std::string& owner, const std::string& id, HttpReply reply) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = futures_.find(id);
  if (it == futures_.end() || it->second.owner != owner) {
    lock.unlock();
    reply(ErrorAnswer(absl::NotFoundError(absl::StrCat("request_id: no request '", id, "'"))));
    return;
  }
  Future& f = it->second;
  if (f.done) {
    HttpAnswer answer = f.answer;
    lock.unlock();
    reply(std::move(answer));
    return;
  }
  auto poll = std::make_shared<HeldPoll>();
  poll->until = std::chrono::steady_clock::now() + options_.poll_window;
  poll->id = id;
  poll->reply = std::move(reply);
  f.polls.push_back(poll);
  held_.push_back(std::move(poll));
}

size_t TinkerFutures::held_polls() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& p : held_) n += p->reply != nullptr;
  return n;
}

void TinkerFutures::AnswerHeldPolls() {
  std::vector<std::pair<std::string, HttpReply>> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& poll : held_) {
      if (poll->reply) held.emplace_back(poll->id, std::move(poll->reply));
      poll->reply = nullptr;
    }
    held_.clear();
    for (auto& [id, f] : futures_) f.polls.clear();
  }
  for (auto& [id, reply] : held) {
    reply(JsonAnswer(nlohmann::json{{"type", "try_again"}, {"request_id", id}, {"queue_state", "active"}}.dump()));
  }
}

void TinkerFutures::Housekeep() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stopping_; });
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::pair<std::string, HttpReply>> expired;
    while (!held_.empty() && (stopping_ || held_.front()->until <= now || !held_.front()->reply)) {
      std::shared_ptr<HeldPoll> poll = std::move(held_.front());
      held_.pop_front();
      if (!poll->reply) continue;
      expired.emplace_back(poll->id, std::move(poll->reply));
      poll->reply = nullptr;
      auto f = futures_.find(poll->id);
      if (f != futures_.end()) {
        auto& polls = f->second.polls;
        polls.erase(std::remove(polls.begin(), polls.end(), poll), polls.end());
      }
    }
    for (auto& [owner, ids] : by_owner_) {
      while (!ids.empty()) {
        auto f = futures_.find(ids.front());
        if (f != futures_.end() && !(f->second.done && now - f->second.done_at > options_.keep_done)) break;
        if (f != futures_.end()) futures_.erase(f);
        ids.pop_front();
      }
    }
    const bool stop = stopping_;
    lock.unlock();
    for (auto& [id, reply] : expired) {
      reply(JsonAnswer(nlohmann::json{{"type", "try_again"}, {"request_id", id}, {"queue_state", "active"}}.dump()));
    }
    if (stop) return;
    lock.lock();
  }
}

}  // namespace lorastep
