#include "rpc/wire_limits.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <climits>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include "absl/strings/str_cat.h"

namespace lorastep {

using google::protobuf::internal::WireFormatLite;

absl::Status CheckRepeatedCountOnWire(const grpc::ByteBuffer& raw, int field_number, const std::string& field_name,
                                      int64_t max_count) {
  grpc::ByteBuffer copy(raw);  // shares the slices; the reader needs a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  int64_t count = 0;
  while (const uint32_t tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == field_number && ++count > max_count) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_name, ": more than ", max_count, " in one request; split the batch over several calls"));
    }
    if (!WireFormatLite::SkipField(&in, tag)) {
      return absl::InvalidArgumentError("request: not a well-formed protobuf message (or nested too deeply)");
    }
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError("request: not a well-formed protobuf message");
  }
  return absl::OkStatus();
}

absl::Status ParseFromByteBuffer(const grpc::ByteBuffer& raw, google::protobuf::Message* message) {
  grpc::ByteBuffer copy(raw);
  grpc::ProtoBufferReader reader(&copy);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  if (!message->ParseFromCodedStream(&in) || !in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request: does not parse as ", message->GetDescriptor()->full_name()));
  }
  return absl::OkStatus();
}

}  // namespace lorastep
