#include "server/admission.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/prometheus_registry.h"

namespace lorastep {
namespace {

constexpr double kMiB = 1 << 20;

std::string Mib(int64_t bytes) { return absl::StrCat(static_cast<double>(bytes) / kMiB, " MiB"); }

}  // namespace

absl::Status AdmissionLimits::Check() const {
  for (const auto& [value, flag] : {std::pair<int64_t, const char*>{calls_per_run, "max_queued_per_run"},
                                    {calls_per_key, "max_queued_per_key"},
                                    {calls_total, "max_queued"},
                                    {bytes_per_key, "max_queued_mb_per_key"},
                                    {bytes_total, "max_queued_mb"}}) {
    if (value <= 0) return absl::InvalidArgumentError(absl::StrCat(flag, ": must be positive"));
  }
  if (calls_per_run > calls_per_key) {
    return absl::InvalidArgumentError(absl::StrCat("max_queued_per_run: ", calls_per_run,
                                                   " is more than --max_queued_per_key (", calls_per_key, ")"));
  }
  // A key's share must leave room for the others, or one key could lock every other out.
  if (calls_per_key >= calls_total) {
    return absl::InvalidArgumentError(absl::StrCat("max_queued_per_key: ", calls_per_key,
                                                   " must be below --max_queued (", calls_total,
                                                   "), so one key cannot hold every slot"));
  }
  if (bytes_per_key >= bytes_total) {
    return absl::InvalidArgumentError(absl::StrCat("max_queued_mb_per_key: ", Mib(bytes_per_key),
                                                   " must be below --max_queued_mb (", Mib(bytes_total),
                                                   "), so one key cannot hold every byte"));
  }
  return absl::OkStatus();
}

AdmissionTicket& AdmissionTicket::operator=(AdmissionTicket&& other) noexcept {
  if (this != &other) {
    Release();
    admission_ = std::exchange(other.admission_, nullptr);
    key_ = std::move(other.key_);
    run_ = std::move(other.run_);
    joined_ = std::exchange(other.joined_, false);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void AdmissionTicket::Release() {
  if (admission_ != nullptr) admission_->ReleaseTicket(this);
  admission_ = nullptr;
}

absl::Status AdmissionTicket::JoinRun(const std::string& run) {
  if (admission_ == nullptr || joined_) return absl::OkStatus();
  Admission& a = *admission_;
  {
    std::lock_guard<std::mutex> lock(a.mu_);
    int64_t& calls = a.calls_by_run_[run];
    if (calls < a.limits_.calls_per_run) {
      ++calls;
      run_ = run;
      joined_ = true;
      return absl::OkStatus();
    }
  }
  return a.Refuse("max_queued_per_run",
                  absl::StrCat("max_queued_per_run: run '", run, "' has ", a.limits_.calls_per_run,
                               " calls in flight; retry after some are answered (they run in order)"));
}

absl::Status AdmissionTicket::AddBytes(int64_t bytes) {
  if (admission_ == nullptr || bytes <= 0) return absl::OkStatus();
  Admission& a = *admission_;
  const char* limit = nullptr;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(a.mu_);
    Admission::Counts& mine = a.by_key_[key_];
    if (mine.bytes + bytes > a.limits_.bytes_per_key) {
      limit = "max_queued_mb_per_key";
      why = absl::StrCat("max_queued_mb_per_key: this key's calls in flight would hold ", Mib(mine.bytes + bytes),
                         " of requests, more than its ", Mib(a.limits_.bytes_per_key),
                         "; retry after some are answered");
    } else if (a.total_.bytes + bytes > a.limits_.bytes_total) {
      limit = "max_queued_mb";
      why = absl::StrCat("max_queued_mb: the coordinator holds ", Mib(a.limits_.bytes_total),
                         " of requests in flight; retry with backoff");
    } else {
      mine.bytes += bytes;
      a.total_.bytes += bytes;
      bytes_ += bytes;
      a.Publish();
      return absl::OkStatus();
    }
  }
  return a.Refuse(limit, why);
}

Admission::Admission(AdmissionLimits limits, PrometheusRegistry* metrics) : limits_(limits), metrics_(metrics) {
  if (metrics_ == nullptr) return;
  metrics_->Declare("lorastep_queue_depth", PrometheusRegistry::Type::kGauge,
                    "Trainer calls accepted and not yet answered (queued behind their run, or running)");
  metrics_->Declare("lorastep_queued_bytes", PrometheusRegistry::Type::kGauge,
                    "bytes of the requests of Trainer calls accepted and not yet answered");
  metrics_->Declare("lorastep_admission_limit", PrometheusRegistry::Type::kGauge,
                    "admission limits by flag (calls, or bytes for the *_mb ones)");
  metrics_->Declare("lorastep_admission_refused_total", PrometheusRegistry::Type::kCounter,
                    "Trainer calls refused RESOURCE_EXHAUSTED at admission, by the limit they would pass");
  for (const auto& [flag, value] : {std::pair<const char*, int64_t>{"max_queued_per_run", limits_.calls_per_run},
                                    {"max_queued_per_key", limits_.calls_per_key},
                                    {"max_queued", limits_.calls_total},
                                    {"max_queued_mb_per_key", limits_.bytes_per_key},
                                    {"max_queued_mb", limits_.bytes_total}}) {
    metrics_->Set("lorastep_admission_limit", {{"limit", flag}}, static_cast<double>(value));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Publish();
}

absl::StatusOr<AdmissionTicket> Admission::Admit(const std::string& key, int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 0);
  const char* limit = nullptr;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Counts& mine = by_key_[key];
    if (mine.calls >= limits_.calls_per_key) {
      limit = "max_queued_per_key";
      why = absl::StrCat("max_queued_per_key: this key has ", limits_.calls_per_key,
                         " calls in flight; retry after some are answered");
    } else if (mine.bytes + bytes > limits_.bytes_per_key) {
      limit = "max_queued_mb_per_key";
      why = absl::StrCat("max_queued_mb_per_key: this key's calls in flight would hold ", Mib(mine.bytes + bytes),
                         " of requests, more than its ", Mib(limits_.bytes_per_key), "; retry after some are answered");
    } else if (total_.calls >= limits_.calls_total) {
      limit = "max_queued";
      why = absl::StrCat("max_queued: ", limits_.calls_total, " calls in flight on this coordinator; retry with "
                         "backoff (from about 100 ms)");
    } else if (total_.bytes + bytes > limits_.bytes_total) {
      limit = "max_queued_mb";
      why = absl::StrCat("max_queued_mb: the coordinator holds ", Mib(limits_.bytes_total),
                         " of requests in flight; retry with backoff");
    } else {
      ++mine.calls;
      mine.bytes += bytes;
      ++total_.calls;
      total_.bytes += bytes;
      Publish();
      AdmissionTicket ticket;
      ticket.admission_ = this;
      ticket.key_ = key;
      ticket.bytes_ = bytes;
      return ticket;
    }
    if (mine.calls == 0 && mine.bytes == 0) by_key_.erase(key);
  }
  return Refuse(limit, why);
}

absl::Status Admission::Refuse(const char* limit, const std::string& why) {
  if (metrics_ != nullptr) metrics_->Add("lorastep_admission_refused_total", {{"limit", limit}});
  return absl::ResourceExhaustedError(why);
}

void Admission::ReleaseTicket(AdmissionTicket* ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto key = by_key_.find(ticket->key_);
  if (key != by_key_.end()) {
    key->second.calls -= 1;
    key->second.bytes -= ticket->bytes_;
    if (key->second.calls <= 0 && key->second.bytes <= 0) by_key_.erase(key);
  }
  total_.calls -= 1;
  total_.bytes -= ticket->bytes_;
  if (ticket->joined_) {
    auto run = calls_by_run_.find(ticket->run_);
    if (run != calls_by_run_.end() && --run->second <= 0) calls_by_run_.erase(run);
  }
  ticket->bytes_ = 0;
  ticket->joined_ = false;
  Publish();
}

void Admission::Publish() {
  if (metrics_ == nullptr) return;
  metrics_->Set("lorastep_queue_depth", {}, static_cast<double>(total_.calls));
  metrics_->Set("lorastep_queued_bytes", {}, static_cast<double>(total_.bytes));
}

Admission::Counts Admission::Total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

Admission::Counts Admission::OfKey(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_key_.find(key);
  return it == by_key_.end() ? Counts{} : it->second;
}

int64_t Admission::CallsOfRun(const std::string& run) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_by_run_.find(run);
  return it == calls_by_run_.end() ? 0 : it->second;
}

}  // namespace lorastep
