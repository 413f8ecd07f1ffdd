// Admission of Trainer calls: each call, and the bytes of its request, counts from the moment
// its body has been read until it is answered, against its tenant (the API key's owner) first,
// then its run, then the whole coordinator. A tenant's shares are below the whole (checked by
// AdmissionLimits::Check), so no single key can hold every queue slot or byte and lock the
// others out. gRPC-free and LibTorch-free.
#ifndef LORASTEP_SERVER_ADMISSION_H_
#define LORASTEP_SERVER_ADMISSION_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lorastep {

class PrometheusRegistry;

struct AdmissionLimits {
  int64_t calls_per_run = 64;             // --max_queued_per_run
  int64_t calls_per_key = 1024;           // --max_queued_per_key
  int64_t calls_total = 4096;             // --max_queued
  int64_t bytes_per_key = int64_t{256} << 20;   // --max_queued_mb_per_key
  int64_t bytes_total = int64_t{1024} << 20;    // --max_queued_mb

  // INVALID_ARGUMENT naming the flag unless every limit is positive, a run's share is at most
  // its key's, and a key's shares are below the whole (calls and bytes).
  absl::Status Check() const;
};

class Admission;

// One admitted call. Move-only; its call, bytes and run slot are released when it is
// destroyed (or Release()d), from any thread.
class AdmissionTicket {
 public:
  AdmissionTicket() = default;
  AdmissionTicket(AdmissionTicket&& other) noexcept { *this = std::move(other); }
  AdmissionTicket& operator=(AdmissionTicket&& other) noexcept;
  AdmissionTicket(const AdmissionTicket&) = delete;
  AdmissionTicket& operator=(const AdmissionTicket&) = delete;
  ~AdmissionTicket() { Release(); }

  // Counts the call against `run` as well (once; its id is known only once the request is
  // parsed). RESOURCE_EXHAUSTED naming --max_queued_per_run when the run is full; the ticket
  // then still holds its key's call and bytes until released.
  absl::Status JoinRun(const std::string& run);
  // Charges `bytes` more to the key and the whole (a stream read chunk by chunk).
  // RESOURCE_EXHAUSTED naming the byte limit that would be passed; nothing is charged then.
  absl::Status AddBytes(int64_t bytes);
  void Release();
  bool held() const { return admission_ != nullptr; }

 private:
  friend class Admission;
  Admission* admission_ = nullptr;
  std::string key_, run_;
  bool joined_ = false;  // counted against run_
  int64_t bytes_ = 0;
};

class Admission {
 public:
  // `metrics` (may be null): where the queue depth, the bytes held, the limits and the
  // refusals by limit are published (docs/OPERATIONS.md).
  explicit Admission(AdmissionLimits limits = {}, PrometheusRegistry* metrics = nullptr);

  // Counts a call of tenant `key` whose request holds `bytes` in, or refuses it with
  // RESOURCE_EXHAUSTED naming the limit it would pass (the key's own limits are checked
  // first, so a refusal names the whole only when the key is within its share). The refusal
  // names no other tenant's figures.
  absl::StatusOr<AdmissionTicket> Admit(const std::string& key, int64_t bytes);

  struct Counts {
    int64_t calls = 0, bytes = 0;
  };
  Counts Total() const;
  Counts OfKey(const std::string& key) const;
  int64_t CallsOfRun(const std::string& run) const;
  const AdmissionLimits& limits() const { return limits_; }

 private:
  friend class AdmissionTicket;
  absl::Status Refuse(const char* limit, const std::string& why);  // counts the refusal
  void Publish();                                                  // under mu_
  void ReleaseTicket(AdmissionTicket* ticket);

  const AdmissionLimits limits_;
  PrometheusRegistry* metrics_;
  mutable std::mutex mu_;
  Counts total_;
  std::map<std::string, Counts> by_key_;
  std::map<std::string, int64_t> calls_by_run_;
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_ADMISSION_H_
