#include "rpc/wire_limits.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <climits>
#include <vector>

#include <google/protobuf/io/coded_stream.h>

namespace lorastep {

WirePieces PiecesOf(const grpc::ByteBuffer& raw, std::shared_ptr<const void>* owner) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  WirePieces pieces;
  if (!raw.Dump(slices.get()).ok()) return pieces;
  for (const grpc::Slice& slice : *slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  *owner = std::move(slices);
  return pieces;
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
