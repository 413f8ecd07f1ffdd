// Exactly-once bookkeeping of one run's mutating calls: the responses of the request_ids
// already applied (bounded by count and by bytes) and the fingerprints that tie each
// request_id to its payload. Contains may be called from any thread (a call is checked before
// it is queued); Find and Keep are called under the run's call lock.
#ifndef LORASTEP_SERVER_REQUEST_RECORDS_H_
#define LORASTEP_SERVER_REQUEST_RECORDS_H_

#include <cstddef>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "rpc/packed_wire.h"

namespace lorastep {

// A request's packed_datums left where they came (PackedDatumsWire), and their field number.
struct PackedField {
  int number = -1;
  const PackedDatumsWire* wire = nullptr;  // null: none apart from the request
};

// SHA-256 of the request's deterministic serialization (map fields in key order), with
// `packed` hashed where that serialization places it: a request hashes the same whether its
// packed datums were parsed into it or left on the wire (when the client serialized them
// canonically, as protobuf's own serializers do).
std::string RequestFingerprint(const google::protobuf::Message& request, const PackedField& packed = {});

// INVALID_ARGUMENT naming request_id when it is empty.
absl::Status RequireRequestId(const std::string& request_id);

// A request's fingerprint computed on another thread while the workers run: serializing and
// hashing a 450 KB batch is about a millisecond of a step. The task reads the request (and
// `packed`), so the destructor waits for it: construct it in the scope that holds them.
class FingerprintTask {
 public:
  FingerprintTask(const std::string& run_id, const google::protobuf::Message& request, const PackedField& packed = {});
  ~FingerprintTask();  // an early return must not leave the hash reading a request that is gone
  std::string Get() { return done_.get(); }

 private:
  std::future<std::string> done_;
};

struct RecordLimits {
  size_t max_requests = 256;           // request_ids remembered
  size_t max_bytes = size_t{64} << 20;  // bytes of responses kept; older bodies are dropped
};

class RequestRecords {
 public:
  explicit RequestRecords(RecordLimits limits) : limits_(limits) {}
  bool Contains(const std::string& request_id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return records_.count(request_id) > 0;
  }
  // The serialized response recorded for `request_id`. INVALID_ARGUMENT when the id was used
  // for another method or with another payload (`fingerprint`); FAILED_PRECONDITION when its
  // response was dropped to bound memory. Requires Contains(request_id).
  absl::StatusOr<const std::string*> Find(const std::string& method, const std::string& request_id,
                                          const std::string& fingerprint) const;
  // Records an applied call. The oldest ids go beyond max_requests; beyond max_bytes the
  // oldest bodies are dropped but their ids and fingerprints stay, so a late retry is refused
  // rather than applied twice.
  void Keep(const std::string& request_id, const std::string& method, std::string response,
            const std::string& fingerprint);
  size_t bytes() const { return bytes_; }

 private:
  struct Recorded {
    std::string method;
    std::string response;     // serialized
    std::string fingerprint;  // of the request
    bool evicted = false;     // the body was dropped; the id stays known
  };
  RecordLimits limits_;
  mutable std::mutex mu_;  // guards records_ and order_ against Contains from other threads
  size_t bytes_ = 0;  // sum of the kept bodies' sizes
  std::map<std::string, Recorded> records_;
  std::deque<std::string> order_;  // oldest first
};

}  // namespace lorastep

#endif  // LORASTEP_SERVER_REQUEST_RECORDS_H_
