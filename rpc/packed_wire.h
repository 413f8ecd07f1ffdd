// A request's `packed_datums` field read where its bytes lie (gRPC's slices, the call pipe's
// read buffer) instead of parsed into a message: the coordinator passes a batch on to the
// worker that checks it without reading its arrays, and a worker converts the arrays to
// datums straight from the bytes it received. Torch- and gRPC-free.
#ifndef LORASTEP_RPC_PACKED_WIRE_H_
#define LORASTEP_RPC_PACKED_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "lib/training/batch.h"
#include "lorastep/v1/trainer.pb.h"
#include "rpc/proto_convert.h"

namespace lorastep {

// Serialized bytes held in pieces, read in order.
using WirePieces = std::vector<absl::string_view>;

// Whether request type `Req` has a packed_datums field (OptimStep's requests do not).
template <typename Req, typename = void>
struct HasPackedDatums : std::false_type {};
template <typename Req>
struct HasPackedDatums<Req, std::void_t<decltype(Req::kPackedDatumsFieldNumber)>> : std::true_type {};

// A top-level field that a scan counts and bounds before anything is parsed.
struct CountedField {
  int number = -1;     // -1: none
  std::string name;    // for the error
  int64_t max_count = 0;
};

// A serialized message with one length-delimited top-level field cut out.
struct FieldCut {
  bool cut = false;   // the field occurred exactly once and was cut out
  int64_t count = 0;  // occurrences of the counted field
  std::string rest;   // the other fields as they came (only when cut)
  WirePieces field;   // the cut field's content, after its tag and length (only when cut)
};

// Scans the top-level fields of the message in `message`: INVALID_ARGUMENT naming
// `counted.name` when that field occurs more than counted.max_count times, or when the bytes
// are not a well-formed message (nesting beyond protobuf's recursion limit included). Cuts
// out length-delimited field `cut_field` (-1: none) when it occurs once; when it occurs more
// often (protobuf merges the occurrences), nothing is cut.
absl::StatusOr<FieldCut> ScanTopLevelFields(const WirePieces& message, int cut_field, const CountedField& counted);

class StagedTail;  // rpc/call_pipe.h

// The content of a `packed_datums` field, left in the bytes it came in. Read() checks its
// structure and reads `lengths`; the arrays' bytes are only located, not read.
class PackedDatumsWire {
 public:
  // `owner` keeps the bytes `pieces` point into alive. INVALID_ARGUMENT when the bytes are not
  // a well-formed PackedDatums message.
  static absl::StatusOr<PackedDatumsWire> Read(WirePieces pieces, std::shared_ptr<const void> owner);

  const WirePieces& pieces() const { return pieces_; }
  size_t size() const { return size_; }
  int num_datums() const { return static_cast<int>(lengths_.size()); }
  // Sum of lengths: the positions, and so the most log-probs an answer carries.
  int64_t num_positions() const;
  // The datums (RequestDatums' checks and errors), converted from the bytes where they lie
  // when those are contiguous, else through a parsed copy.
  absl::StatusOr<std::vector<Datum>> Datums(const google::protobuf::RepeatedPtrField<v1::Datum>& unpacked) const;
  // A parsed copy.
  absl::Status ParseInto(v1::PackedDatums* packed) const;
  // The arrays as views of the bytes, when those are contiguous (one piece); else none.
  std::optional<PackedArrays> Arrays() const;
  // A copy of these bytes already made where their next hop reads them (a spawned worker's
  // shared region, by the thread that received them); null: none. Kept with the wire.
  const StagedTail* staged() const { return staged_.get(); }
  void set_staged(std::shared_ptr<const StagedTail> staged) { staged_ = std::move(staged); }

 private:
  struct Span {
    size_t begin = 0;
    size_t end = 0;
  };
  WirePieces pieces_;
  std::shared_ptr<const void> owner_;
  size_t size_ = 0;
  std::vector<int32_t> lengths_;
  Span arrays_[10];  // by PackedDatums field number (2..9): the last occurrence, as protobuf keeps it
  std::shared_ptr<const StagedTail> staged_;
};

// `request`'s deterministic serialization with field `packed_field` (absent from `request`)
// put back where that serialization places it, as `packed`'s bytes: the bytes of the whole
// request serialized deterministically, when the client serialized the field canonically.
// The pieces point into `*storage` and `packed`.
WirePieces SerializationWithPackedField(const google::protobuf::Message& request, int packed_field,
                                        const PackedDatumsWire& packed, std::string* storage);

}  // namespace lorastep

#endif  // LORASTEP_RPC_PACKED_WIRE_H_
