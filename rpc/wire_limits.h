// Limits checked on a request's wire bytes before it is parsed: a protobuf message of many
// tiny repeated submessages parses to far more memory than its size (about 90 times for
// one-token datums), so their count is bounded first.
#ifndef LORASTEP_RPC_WIRE_LIMITS_H_
#define LORASTEP_RPC_WIRE_LIMITS_H_

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "rpc/packed_wire.h"

namespace lorastep {

// The most memory parsing `wire_bytes` of a Trainer request holding `datums` datums may
// take: a repeated integer of one-byte varints becomes 8 bytes a value, and each datum is a
// message of its own (packed_datums are read where they lie and are not counted here).
inline int64_t ParsedBytesBound(int64_t wire_bytes, int64_t datums) { return 8 * wire_bytes + 512 * datums; }

// Parses `raw` into `message`; INVALID_ARGUMENT naming the message type when it does not parse.
absl::Status ParseFromByteBuffer(const grpc::ByteBuffer& raw, google::protobuf::Message* message);
// `raw`'s bytes where gRPC holds them; `*owner` keeps them alive. Empty when gRPC cannot say.
WirePieces PiecesOf(const grpc::ByteBuffer& raw, std::shared_ptr<const void>* owner);

// A Trainer request with `datums` and `packed_datums` fields: its datums counted on the wire
// (at most `max_datums`; INVALID_ARGUMENT naming datums, or saying that the bytes are not a
// well-formed message, nesting deeper than protobuf's limit included), then parsed into `request`, except its packed_datums, which stay
// where gRPC holds them, read by `*packed` (set only when the request has them, in one field).
//
// `before_parse` (may be empty) is told, once the datums are counted and before anything is
// parsed, how many bytes the parse may take at most (ParsedBytesBound); an error from it is
// returned and nothing is parsed.
template <typename Req>
absl::Status ParseBoundedRequest(const grpc::ByteBuffer& raw, int64_t max_datums, Req* request,
                                 std::optional<PackedDatumsWire>* packed,
                                 const std::function<absl::Status(int64_t)>& before_parse = nullptr) {
  std::shared_ptr<const void> owner;
  const WirePieces pieces = PiecesOf(raw, &owner);
  const CountedField datums{Req::kDatumsFieldNumber, "datums", max_datums};
  absl::StatusOr<FieldCut> cut = ScanTopLevelFields(pieces, Req::kPackedDatumsFieldNumber, datums);
  if (!cut.ok()) return cut.status();
  if (before_parse) {
    const int64_t parsed = static_cast<int64_t>(cut->cut ? cut->rest.size() : raw.Length());
    if (absl::Status s = before_parse(ParsedBytesBound(parsed, cut->count)); !s.ok()) return s;
  }
  if (!cut->cut) return ParseFromByteBuffer(raw, request);
  absl::StatusOr<PackedDatumsWire> wire;
  if (request->ParseFromString(cut->rest)) wire = PackedDatumsWire::Read(std::move(cut->field), std::move(owner));
  if (!wire.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request: does not parse as ", Req::descriptor()->full_name()));
  }
  packed->emplace(*std::move(wire));
  return absl::OkStatus();
}

}  // namespace lorastep

#endif  // LORASTEP_RPC_WIRE_LIMITS_H_
