#include "server/request_records.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <openssl/evp.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/serial_executor.h"

namespace lorastep {
namespace {

// The hashing runs on long-lived threads, keyed by run so one run's hashes do not queue
// behind another's: a thread per call (std::async) pays thread creation on every step.
KeyedExecutor& FingerprintThreads() {
  static KeyedExecutor* threads = new KeyedExecutor(2);  // never joined: lives as long as the process
  return *threads;
}

}  // namespace

std::string RequestFingerprint(const google::protobuf::Message& request, const PackedField& packed) {
  std::string bytes;
  WirePieces pieces;
  if (packed.wire != nullptr) {
    pieces = SerializationWithPackedField(request, packed.number, *packed.wire, &bytes);
  } else {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&out);
  }  // the streams trim `bytes` to what was written when they go
  if (packed.wire == nullptr) pieces.push_back(bytes);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  for (absl::string_view piece : pieces) EVP_DigestUpdate(ctx.get(), piece.data(), piece.size());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  return std::string(reinterpret_cast<const char*>(digest), len);
}

absl::Status RequireRequestId(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: required for this call");
  return absl::OkStatus();
}

FingerprintTask::FingerprintTask(const std::string& run_id, const google::protobuf::Message& request,
                                 const PackedField& packed) {
  auto promise = std::make_shared<std::promise<std::string>>();
  done_ = promise->get_future();
  FingerprintThreads().Submit(run_id,
                              [promise, &request, packed] { promise->set_value(RequestFingerprint(request, packed)); });
}

FingerprintTask::~FingerprintTask() {
  if (done_.valid()) done_.wait();
}

absl::StatusOr<const std::string*> RequestRecords::Find(const std::string& method, const std::string& request_id,
                                                        const std::string& fingerprint) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Recorded& rec = records_.at(request_id);
  if (rec.method != method) {
    return absl::InvalidArgumentError(absl::StrCat("request_id: '", request_id, "' was used for ", rec.method));
  }
  if (rec.evicted) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request_id: '", request_id, "' was applied, but its response is no longer kept (the "
        "run's recorded responses exceeded --max_recorded_mb); nothing was applied again"));
  }
  if (rec.fingerprint != fingerprint) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_id: '", request_id, "' was already used for a different ", method,
        " request (the payload differs); a retry must resend the same request, a new "
        "request needs a new request_id"));
  }
  return &rec.response;
}

void RequestRecords::Keep(const std::string& request_id, const std::string& method, std::string response,
                          const std::string& fingerprint) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto known = records_.find(request_id); known != records_.end()) {  // kept once, as the newest
    bytes_ -= known->second.response.size();
    order_.erase(std::find(order_.begin(), order_.end(), request_id));
  }
  Recorded& rec = records_[request_id];
  rec = {method, std::move(response), fingerprint, false};
  bytes_ += rec.response.size();
  order_.push_back(request_id);
  while (order_.size() > limits_.max_requests) {
    bytes_ -= records_.at(order_.front()).response.size();
    records_.erase(order_.front());
    order_.pop_front();
  }
  for (const std::string& id : order_) {
    if (bytes_ <= limits_.max_bytes) break;
    Recorded& old = records_.at(id);
    if (old.evicted || id == request_id) continue;
    bytes_ -= old.response.size();
    old.response = std::string();
    old.evicted = true;
  }
}

}  // namespace lorastep
