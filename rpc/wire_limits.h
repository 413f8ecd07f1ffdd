// Limits checked on a request's wire bytes before it is parsed: a protobuf message of many
// tiny repeated submessages parses to far more memory than its size (about 90 times for
// one-token datums), so their count is bounded first.
#ifndef LORASTEP_RPC_WIRE_LIMITS_H_
#define LORASTEP_RPC_WIRE_LIMITS_H_

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <string>

#include <google/protobuf/message.h>

#include "absl/status/status.h"

namespace lorastep {

// INVALID_ARGUMENT naming `field_name` when the top-level field `field_number` occurs more
// than `max_count` times in the serialized message `raw`, or when `raw` is not a well-formed
// message (nesting deeper than protobuf's recursion limit included).
absl::Status CheckRepeatedCountOnWire(const grpc::ByteBuffer& raw, int field_number, const std::string& field_name,
                                      int64_t max_count);
// Parses `raw` into `message`; INVALID_ARGUMENT naming the message type when it does not parse.
absl::Status ParseFromByteBuffer(const grpc::ByteBuffer& raw, google::protobuf::Message* message);

// A Trainer request with a `datums` field: its datums counted on the wire (at most
// `max_datums`), then parsed into `request`.
template <typename Req>
absl::Status ParseBoundedRequest(const grpc::ByteBuffer& raw, int64_t max_datums, Req* request) {
  if (const auto* datums = Req::descriptor()->FindFieldByName("datums"); datums != nullptr) {
    absl::Status counted = CheckRepeatedCountOnWire(raw, datums->number(), "datums", max_datums);
    if (!counted.ok()) return counted;
  }
  return ParseFromByteBuffer(raw, request);
}

}  // namespace lorastep

#endif  // LORASTEP_RPC_WIRE_LIMITS_H_
