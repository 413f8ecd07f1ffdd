// The key-value store the ranks of a mesh across hosts meet at, without c10d's TCPStore (which
// has no authentication): rank 0 holds a RendezvousStoreHost and serves it over its
// authenticated transport (the worker's gRPC port behind the cluster secret); every rank,
// rank 0 included, reaches it through a StoreTransport, and ProcessGroups wraps that in a c10d
// Store for gloo and NCCL to rendezvous on.
//
// Semantics are c10d's: values are bytes; `add` keeps a decimal counter (absent = 0);
// `compare_set` sets when the current value equals `expected` (absent counts as empty). The
// host never blocks: waiting for a key is the client's polling (remote_store in
// process_groups.cc), so no server thread is held by a rank that waits.
//
// Example:
//   RendezvousStoreHost host;
//   StoreTransport local = host.LocalTransport();
//   ASSIGN_OR_RETURN(StoreAnswer a, local({StoreOp::kAdd, {"n"}, "", "", 1}, absl::Seconds(1)));
//
// Thread-safe.
#ifndef LORASTEP_LIB_PARALLEL_RENDEZVOUS_STORE_H_
#define LORASTEP_LIB_PARALLEL_RENDEZVOUS_STORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lorastep {

struct StoreOp {
  enum Kind { kSet = 1, kGet, kAdd, kCompareSet, kCheck, kDeleteKey, kNumKeys };
  Kind kind = kGet;
  std::vector<std::string> keys;  // one, or several for kCheck; none for kNumKeys
  std::string value;              // kSet: the value; kCompareSet: the desired value
  std::string expected;           // kCompareSet
  int64_t delta = 0;              // kAdd
};

struct StoreAnswer {
  bool found = false;  // kGet: the key exists; kCheck: all do; kDeleteKey: it existed
  std::string value;   // kGet, kCompareSet: the value now
  int64_t number = 0;  // kAdd: the counter now; kNumKeys: the count
};

// One operation on the store, finished within `timeout` or failed (UNAVAILABLE, ...).
using StoreTransport = std::function<absl::StatusOr<StoreAnswer>(const StoreOp&, std::chrono::milliseconds timeout)>;

// Limits one store holds to (authenticated members only reach it; the limits bound a buggy one).
struct RendezvousStoreLimits {
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 1 << 20;
  size_t max_keys_per_op = 1024;
  size_t max_keys = 1 << 16;
  size_t max_total_bytes = 64 << 20;
};

class RendezvousStoreHost {
 public:
  explicit RendezvousStoreHost(RendezvousStoreLimits limits = {}) : limits_(limits) {}

  // INVALID_ARGUMENT naming the field for a malformed op, RESOURCE_EXHAUSTED past a limit;
  // the store is unchanged by a refused op.
  absl::StatusOr<StoreAnswer> Apply(const StoreOp& op);
  // A transport that applies ops here, in this process (what rank 0 itself uses).
  StoreTransport LocalTransport();

 private:
  absl::Status Fits(const std::string& key, size_t new_value_bytes) const;  // under mu_

  const RendezvousStoreLimits limits_;
  std::mutex mu_;
  std::map<std::string, std::string> values_;
  size_t total_bytes_ = 0;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARALLEL_RENDEZVOUS_STORE_H_
