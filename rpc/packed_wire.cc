#include "rpc/packed_wire.h"

#include <algorithm>
#include <climits>
#include <deque>
#include <optional>
#include <utility>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {

using google::protobuf::io::ArrayInputStream;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

// One input stream over the pieces, in order.
class PiecesInput {
 public:
  explicit PiecesInput(const WirePieces& pieces) {
    for (absl::string_view piece : pieces) {
      arrays_.emplace_back(piece.data(), static_cast<int>(piece.size()));
    }
    for (ArrayInputStream& array : arrays_) streams_.push_back(&array);
    concatenated_.emplace(streams_.data(), static_cast<int>(streams_.size()));
  }
  google::protobuf::io::ZeroCopyInputStream* stream() { return &*concatenated_; }

 private:
  std::deque<ArrayInputStream> arrays_;  // a deque: streams_ points into it
  std::vector<google::protobuf::io::ZeroCopyInputStream*> streams_;
  std::optional<google::protobuf::io::ConcatenatingInputStream> concatenated_;
};

// Bytes [begin, end) of `pieces`, as views.
WirePieces RangeOf(const WirePieces& pieces, size_t begin, size_t end) {
  WirePieces out;
  size_t at = 0;
  for (absl::string_view piece : pieces) {
    const size_t piece_begin = at;
    at += piece.size();
    if (at <= begin || piece_begin >= end) continue;
    const size_t from = std::max(begin, piece_begin) - piece_begin;
    out.push_back(piece.substr(from, std::min(end, at) - piece_begin - from));
  }
  return out;
}

void AppendRange(const WirePieces& pieces, size_t begin, size_t end, std::string* out) {
  for (absl::string_view piece : RangeOf(pieces, begin, end)) out->append(piece.data(), piece.size());
}

// Reads a length-delimited field's length and skips its content; the content's offset.
bool SkipLengthDelimited(CodedInputStream* in, size_t* content_begin, uint32_t* length) {
  if (!in->ReadVarint32(length) || *length > static_cast<uint32_t>(INT_MAX)) return false;
  *content_begin = static_cast<size_t>(in->CurrentPosition());
  return in->Skip(static_cast<int>(*length));
}

absl::Status MalformedPacked() {
  return absl::InvalidArgumentError("packed_datums: not a well-formed PackedDatums message");
}

absl::Status Malformed(bool nesting) {
  return absl::InvalidArgumentError(
      nesting ? "request: not a well-formed protobuf message (or nested too deeply)"
              : "request: not a well-formed protobuf message");
}

}  // namespace

absl::StatusOr<FieldCut> ScanTopLevelFields(const WirePieces& message, int cut_field, const CountedField& counted) {
  PiecesInput input(message);
  CodedInputStream in(input.stream());
  in.SetTotalBytesLimit(INT_MAX);
  int64_t count = 0;
  int occurrences = 0;
  size_t field_begin = 0;
  size_t content_begin = 0;
  size_t content_end = 0;
  while (true) {
    const size_t at = static_cast<size_t>(in.CurrentPosition());
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    if (number == counted.number && ++count > counted.max_count) {
      return absl::InvalidArgumentError(absl::StrCat(counted.name, ": more than ", counted.max_count,
                                                     " in one request; split the batch over several calls"));
    }
    if (number == cut_field && WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!SkipLengthDelimited(&in, &content_begin, &length)) return Malformed(false);
      ++occurrences;
      field_begin = at;
      content_end = content_begin + length;
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return Malformed(true);
  }
  if (!in.ConsumedEntireMessage()) return Malformed(false);
  FieldCut cut;
  cut.count = count;
  if (occurrences != 1) return cut;
  const size_t total = static_cast<size_t>(in.CurrentPosition());
  cut.cut = true;
  cut.rest.reserve(total - (content_end - field_begin));
  AppendRange(message, 0, field_begin, &cut.rest);
  AppendRange(message, content_end, total, &cut.rest);
  cut.field = RangeOf(message, content_begin, content_end);
  return cut;
}

absl::StatusOr<PackedDatumsWire> PackedDatumsWire::Read(WirePieces pieces, std::shared_ptr<const void> owner) {
  PackedDatumsWire wire;
  {
    PiecesInput input(pieces);
    CodedInputStream in(input.stream());
    in.SetTotalBytesLimit(INT_MAX);
    while (const uint32_t tag = in.ReadTag()) {
      const int number = WireFormatLite::GetTagFieldNumber(tag);
      const auto type = WireFormatLite::GetTagWireType(tag);
      if (number == v1::PackedDatums::kLengthsFieldNumber && type == WireFormatLite::WIRETYPE_VARINT) {
        uint64_t value = 0;
        if (!in.ReadVarint64(&value)) return MalformedPacked();
        wire.lengths_.push_back(static_cast<int32_t>(value));  // int32's varint: the low 32 bits
        continue;
      }
      if (number == v1::PackedDatums::kLengthsFieldNumber && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        uint32_t length = 0;
        if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(INT_MAX)) return MalformedPacked();
        const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
        while (in.BytesUntilLimit() > 0) {
          uint64_t value = 0;
          if (!in.ReadVarint64(&value)) return MalformedPacked();
          wire.lengths_.push_back(static_cast<int32_t>(value));
        }
        in.PopLimit(limit);
        continue;
      }
      if (number >= v1::PackedDatums::kTokensFieldNumber && number <= v1::PackedDatums::kLastTargetTokensFieldNumber &&
          type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        size_t begin = 0;
        uint32_t length = 0;
        if (!SkipLengthDelimited(&in, &begin, &length)) return MalformedPacked();
        wire.arrays_[number] = Span{begin, begin + length};
        continue;
      }
      if (!WireFormatLite::SkipField(&in, tag)) return MalformedPacked();
    }
    if (!in.ConsumedEntireMessage()) return MalformedPacked();
  }
  for (absl::string_view piece : pieces) wire.size_ += piece.size();
  wire.pieces_ = std::move(pieces);
  wire.owner_ = std::move(owner);
  return wire;
}

int64_t PackedDatumsWire::num_positions() const {
  int64_t total = 0;
  for (int32_t length : lengths_) total += length;
  return total;
}

absl::Status PackedDatumsWire::ParseInto(v1::PackedDatums* packed) const {
  PiecesInput input(pieces_);
  return packed->ParseFromZeroCopyStream(input.stream()) ? absl::OkStatus() : MalformedPacked();
}

absl::StatusOr<std::vector<Datum>> PackedDatumsWire::Datums(
    const google::protobuf::RepeatedPtrField<v1::Datum>& unpacked) const {
  if (std::optional<PackedArrays> arrays = Arrays()) return RequestDatums(unpacked, *arrays);
  v1::PackedDatums parsed;
  if (absl::Status s = ParseInto(&parsed); !s.ok()) return s;
  return RequestDatums(unpacked, parsed);
}

std::optional<PackedArrays> PackedDatumsWire::Arrays() const {
  if (pieces_.size() > 1) return std::nullopt;
  const absl::string_view bytes = pieces_.empty() ? absl::string_view() : pieces_[0];
  auto array = [&](int number) { return bytes.substr(arrays_[number].begin, arrays_[number].end - arrays_[number].begin); };
  PackedArrays arrays;
  arrays.lengths = lengths_;
  arrays.tokens = array(v1::PackedDatums::kTokensFieldNumber);
  arrays.target_tokens = array(v1::PackedDatums::kTargetTokensFieldNumber);
  arrays.weights = array(v1::PackedDatums::kWeightsFieldNumber);
  arrays.logprobs = array(v1::PackedDatums::kLogprobsFieldNumber);
  arrays.advantages = array(v1::PackedDatums::kAdvantagesFieldNumber);
  arrays.ref_logprobs = array(v1::PackedDatums::kRefLogprobsFieldNumber);
  arrays.old_logprobs = array(v1::PackedDatums::kOldLogprobsFieldNumber);
  arrays.last_target_tokens = array(v1::PackedDatums::kLastTargetTokensFieldNumber);
  return arrays;
}

WirePieces SerializationWithPackedField(const google::protobuf::Message& request, int packed_field,
                                        const PackedDatumsWire& packed, std::string* storage) {
  storage->clear();
  {
    google::protobuf::io::StringOutputStream stream(storage);
    CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&out);
  }
  const size_t serialized = storage->size();
  // Known fields are written in field-number order, unknown ones after them: the field goes
  // before the first field of a higher number or unknown to the message's descriptor.
  size_t insert_at = serialized;
  {
    CodedInputStream in(reinterpret_cast<const uint8_t*>(storage->data()), static_cast<int>(serialized));
    while (true) {
      const size_t at = static_cast<size_t>(in.CurrentPosition());
      const uint32_t tag = in.ReadTag();
      if (tag == 0) break;
      const int number = WireFormatLite::GetTagFieldNumber(tag);
      if (number > packed_field || request.GetDescriptor()->FindFieldByNumber(number) == nullptr) {
        insert_at = at;
        break;
      }
      if (!WireFormatLite::SkipField(&in, tag)) break;
    }
  }
  *storage += LengthDelimitedHead(packed_field, packed.size());
  const absl::string_view all(*storage);  // no more appends: the views stay valid
  WirePieces out{all.substr(0, insert_at), all.substr(serialized)};
  out.insert(out.end(), packed.pieces().begin(), packed.pieces().end());
  out.push_back(all.substr(insert_at, serialized - insert_at));
  return out;
}

}  // namespace lorastep
