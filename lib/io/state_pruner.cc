#include "lib/io/state_pruner.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include "absl/strings/str_join.h"
#include "lib/io/state_store.h"
#include "lib/log.h"

namespace lorastep {

StatePruner::StatePruner(std::string state_dir, int64_t ttl_s)
    : state_dir_(std::move(state_dir)), ttl_s_(std::max<int64_t>(1, ttl_s)), thread_([this] { Loop(); }) {}

StatePruner::~StatePruner() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void StatePruner::Loop() {
  auto store = StateStore::Open(state_dir_);
  const auto every = std::chrono::seconds(std::clamp<int64_t>(ttl_s_ / 10, 1, 600));
  std::unique_lock<std::mutex> lock(mu_);
  do {
    auto removed = store.ok() ? store->PruneOlderThan(ttl_s_, static_cast<int64_t>(std::time(nullptr)))
                              : absl::StatusOr<std::vector<std::string>>(store.status());
    if (!removed.ok()) {
      LORASTEP_LOG(Warning) << "state store TTL: " << removed.status();
    } else if (!removed->empty()) {
      LORASTEP_LOG(Info) << "state store TTL removed " << removed->size() << " folder(s): "
                         << absl::StrJoin(*removed, ", ");
    }
  } while (!stop_cv_.wait_for(lock, every, [&] { return stopping_; }));
}

}  // namespace lorastep
