#include "lib/parallel/rendezvous_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"

namespace lorastep {

absl::Status RendezvousStoreHost::Fits(const std::string& key, size_t new_value_bytes) const {
  if (new_value_bytes > limits_.max_value_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("value: ", new_value_bytes, " bytes, over the store's limit of ",
                                                     limits_.max_value_bytes));
  }
  auto it = values_.find(key);
  const size_t old_bytes = it == values_.end() ? 0 : key.size() + it->second.size();
  if (it == values_.end() && values_.size() >= limits_.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat("keys: the store holds its limit of ", limits_.max_keys, " keys"));
  }
  if (total_bytes_ - old_bytes + key.size() + new_value_bytes > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("value: the store would exceed its limit of ",
                                                     limits_.max_total_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StoreAnswer> RendezvousStoreHost::Apply(const StoreOp& op) {
  const size_t want_keys = op.kind == StoreOp::kNumKeys ? 0 : op.kind == StoreOp::kCheck ? op.keys.size() : 1;
  if (op.kind < StoreOp::kSet || op.kind > StoreOp::kNumKeys) {
    return absl::InvalidArgumentError(absl::StrCat("kind: ", static_cast<int>(op.kind), " is not a store operation"));
  }
  if (op.kind == StoreOp::kCheck ? (op.keys.empty() || op.keys.size() > limits_.max_keys_per_op)
                                 : op.keys.size() != want_keys) {
    return absl::InvalidArgumentError(absl::StrCat("keys: ", op.keys.size(), " given, this operation takes ",
                                                   op.kind == StoreOp::kCheck ? absl::StrCat("1 to ", limits_.max_keys_per_op)
                                                                              : absl::StrCat(want_keys)));
  }
  for (const std::string& key : op.keys) {
    if (key.empty() || key.size() > limits_.max_key_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("keys: a key of ", key.size(), " bytes; keys take 1 to ",
                                                     limits_.max_key_bytes));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  StoreAnswer answer;
  auto put = [&](const std::string& key, std::string value) {
    auto it = values_.find(key);
    if (it != values_.end()) total_bytes_ -= key.size() + it->second.size();
    total_bytes_ += key.size() + value.size();
    values_[key] = std::move(value);
  };
  switch (op.kind) {
    case StoreOp::kSet:
      LORASTEP_RETURN_IF_ERROR(Fits(op.keys[0], op.value.size()));
      put(op.keys[0], op.value);
      break;
    case StoreOp::kGet: {
      auto it = values_.find(op.keys[0]);
      answer.found = it != values_.end();
      if (answer.found) answer.value = it->second;
      break;
    }
    case StoreOp::kAdd: {
      auto it = values_.find(op.keys[0]);
      int64_t now = 0;
      if (it != values_.end() && !absl::SimpleAtoi(it->second, &now)) {
        return absl::FailedPreconditionError(absl::StrCat("keys: '", op.keys[0], "' holds no counter"));
      }
      now += op.delta;
      std::string text = absl::StrCat(now);
      LORASTEP_RETURN_IF_ERROR(Fits(op.keys[0], text.size()));
      put(op.keys[0], std::move(text));
      answer.number = now;
      break;
    }
    case StoreOp::kCompareSet: {
      auto it = values_.find(op.keys[0]);
      const std::string current = it == values_.end() ? "" : it->second;
      if ((it == values_.end() && op.expected.empty()) || (it != values_.end() && current == op.expected)) {
        LORASTEP_RETURN_IF_ERROR(Fits(op.keys[0], op.value.size()));
        put(op.keys[0], op.value);
        answer.value = op.value;
      } else {
        answer.value = it == values_.end() ? op.expected : current;
      }
      break;
    }
    case StoreOp::kCheck:
      answer.found = true;
      for (const std::string& key : op.keys) answer.found = answer.found && values_.count(key) > 0;
      break;
    case StoreOp::kDeleteKey: {
      auto it = values_.find(op.keys[0]);
      answer.found = it != values_.end();
      if (answer.found) {
        total_bytes_ -= it->first.size() + it->second.size();
        values_.erase(it);
      }
      break;
    }
    case StoreOp::kNumKeys:
      answer.number = static_cast<int64_t>(values_.size());
      break;
  }
  return answer;
}

StoreTransport RendezvousStoreHost::LocalTransport() {
  return [this](const StoreOp& op, std::chrono::milliseconds) { return Apply(op); };
}

}  // namespace lorastep
