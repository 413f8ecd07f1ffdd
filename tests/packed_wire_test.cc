// A request's packed_datums read where its bytes lie (rpc/packed_wire.h): the cut leaves the
// rest of the request as it came, the datums convert as the parsed message's do (same
// refusals), and the request's fingerprint is the one of the whole request parsed.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/util/message_differencer.h>

#include "bench/bench_batch.h"
#include "gtest/gtest.h"
#include "rpc/packed_wire.h"
#include "rpc/proto_convert.h"
#include "server/request_records.h"

namespace lorastep {
namespace {

using google::protobuf::util::MessageDifferencer;

v1::PackedDatums Packed(const std::vector<int>& lengths, int first_token) {
  std::vector<v1::Datum> datums;
  for (int length : lengths) {
    v1::Datum& d = datums.emplace_back();
    for (int i = 0; i < length; ++i) {
      d.add_tokens(first_token + i);
      d.add_target_tokens(first_token + i + 1);
      d.add_weights(0.5f * static_cast<float>(i));
      d.add_advantages(-1.0f + static_cast<float>(i));
    }
  }
  v1::PackedDatums packed;
  EXPECT_TRUE(PackDatums(datums, &packed));
  return packed;
}

// Fields before and after packed_datums (9), a map among them.
v1::TrainStepRequest Request() {
  v1::TrainStepRequest req;
  req.set_run_id("r");
  req.set_request_id("q-1");
  req.set_sequence_id(4);
  req.mutable_loss()->set_loss_fn("ppo");
  req.mutable_adamw()->set_lr(1e-4);
  (*req.mutable_client_metrics())["b"] = 1;
  (*req.mutable_client_metrics())["a"] = 2;
  *req.mutable_packed_datums() = Packed({3, 5, 2}, 7);
  req.set_activation_recompute("full");
  return req;
}

WirePieces InPieces(const std::string& bytes, size_t piece) {
  WirePieces pieces;
  for (size_t at = 0; at < bytes.size(); at += piece) pieces.push_back(absl::string_view(bytes).substr(at, piece));
  return pieces;
}

std::string Joined(const WirePieces& pieces) {
  std::string out;
  for (absl::string_view piece : pieces) out.append(piece.data(), piece.size());
  return out;
}

const CountedField kDatums{v1::TrainStepRequest::kDatumsFieldNumber, "datums", 10};

// The service benchmark's random batch: with next-token targets (an RL rollout's) the client
// sends one last target per datum; with targets of their own it sends them whole. Both unpack
// to the batch as generated.
TEST(BenchBatchTest, NextTokenTargetsPackAsLastTargetsAndRandomOnesWhole) {
  for (const bool next : {true, false}) {
    const std::vector<v1::Datum> batch = RandomBatch(3, 7, 1000, /*seed=*/1, next);
    v1::PackedDatums packed;
    ASSERT_TRUE(PackDatums(batch, &packed));
    EXPECT_EQ(packed.last_target_tokens().size(), next ? 3u * 4 : 0u) << next;
    EXPECT_EQ(packed.target_tokens().size(), next ? 0u : 21u * 4) << next;
    absl::StatusOr<std::vector<Datum>> unpacked = RequestDatums({}, packed);
    ASSERT_TRUE(unpacked.ok()) << unpacked.status();
    ASSERT_EQ(unpacked->size(), 3u);
    for (int d = 0; d < 3; ++d) {
      EXPECT_EQ((*unpacked)[d].tokens, std::vector<int64_t>(batch[d].tokens().begin(), batch[d].tokens().end()));
      EXPECT_EQ((*unpacked)[d].target_tokens,
                std::vector<int64_t>(batch[d].target_tokens().begin(), batch[d].target_tokens().end()));
    }
  }
}

TEST(ScanTopLevelFieldsTest, CutsThePackedFieldOutOfARequestInPieces) {
  const v1::TrainStepRequest full = Request();
  const std::string bytes = full.SerializeAsString();
  v1::TrainStepRequest stripped = full;
  stripped.clear_packed_datums();
  for (size_t piece : {size_t{1}, size_t{3}, size_t{64}, bytes.size()}) {
    absl::StatusOr<FieldCut> cut =
        ScanTopLevelFields(InPieces(bytes, piece), v1::TrainStepRequest::kPackedDatumsFieldNumber, kDatums);
    ASSERT_TRUE(cut.ok()) << cut.status();
    ASSERT_TRUE(cut->cut) << piece;
    v1::TrainStepRequest rest;
    ASSERT_TRUE(rest.ParseFromString(cut->rest));
    EXPECT_TRUE(MessageDifferencer::Equals(rest, stripped)) << piece;
    EXPECT_EQ(Joined(cut->field), full.packed_datums().SerializeAsString()) << piece;
  }
}

TEST(ScanTopLevelFieldsTest, CountsBeforeParsingAndRefusesMalformedBytes) {
  v1::TrainStepRequest many;
  for (int i = 0; i < 3; ++i) many.add_datums()->add_tokens(i);
  const CountedField two{v1::TrainStepRequest::kDatumsFieldNumber, "datums", 2};
  absl::StatusOr<FieldCut> cut = ScanTopLevelFields({many.SerializeAsString()}, 9, two);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(cut.status().message()),
            "datums: more than 2 in one request; split the batch over several calls");
  const std::string malformed = "request: not a well-formed protobuf message";
  const std::string nested = malformed + " (or nested too deeply)";
  cut = ScanTopLevelFields({std::string("\x0a\x05" "ab", 4)}, 9, kDatums);  // a string cut short
  EXPECT_EQ(std::string(cut.status().message()), nested);
  cut = ScanTopLevelFields({std::string("\x00\x01", 2)}, 9, kDatums);  // tag 0
  EXPECT_EQ(std::string(cut.status().message()), malformed);
  cut = ScanTopLevelFields({std::string("\x4a\x05" "ab", 4)}, 9, kDatums);  // the packed field cut short
  EXPECT_EQ(std::string(cut.status().message()), malformed);
  cut = ScanTopLevelFields({std::string(200, '\x0b')}, 9, kDatums);  // groups nested 200 deep
  EXPECT_EQ(std::string(cut.status().message()), nested);
}

TEST(ScanTopLevelFieldsTest, AFieldSentTwiceIsLeftWhole) {
  // Protobuf merges the two occurrences; the caller parses the request whole instead.
  v1::TrainStepRequest second;
  *second.mutable_packed_datums() = Packed({1}, 3);
  const std::string bytes = Request().SerializeAsString() + second.SerializeAsString();
  absl::StatusOr<FieldCut> cut = ScanTopLevelFields({bytes}, 9, kDatums);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_FALSE(cut->cut);
  EXPECT_TRUE(cut->rest.empty());
}

// The wire's datums and refusals against RequestDatums on the parsed message, contiguous and
// in pieces.
void ExpectConvertsAsParsed(const std::string& bytes) {
  v1::PackedDatums parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  const google::protobuf::RepeatedPtrField<v1::Datum> none;
  const absl::StatusOr<std::vector<Datum>> expected = RequestDatums(none, parsed);
  auto owner = std::make_shared<const std::string>(bytes);
  for (size_t piece : {size_t{5}, bytes.size() + 1}) {
    absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read(InPieces(*owner, piece), owner);
    ASSERT_TRUE(wire.ok()) << wire.status();
    EXPECT_EQ(wire->size(), bytes.size());
    EXPECT_EQ(wire->num_datums(), parsed.lengths_size());
    const absl::StatusOr<std::vector<Datum>> got = wire->Datums(none);
    ASSERT_EQ(got.status(), expected.status()) << piece;
    if (!got.ok()) continue;
    ASSERT_EQ(got->size(), expected->size());
    int64_t positions = 0;
    for (size_t i = 0; i < got->size(); ++i) {
      const Datum& a = (*got)[i];
      const Datum& b = (*expected)[i];
      EXPECT_EQ(a.tokens, b.tokens);
      EXPECT_EQ(a.target_tokens, b.target_tokens);
      EXPECT_EQ(a.weights, b.weights);
      EXPECT_EQ(a.advantages, b.advantages);
      EXPECT_EQ(a.logprobs, b.logprobs);
      positions += static_cast<int64_t>(a.tokens.size());
    }
    EXPECT_EQ(wire->num_positions(), positions);
    // Unpacked in two ranges (as the worker does on two threads): the same datums.
    std::optional<PackedArrays> arrays = wire->Arrays();
    ASSERT_EQ(arrays.has_value(), piece > bytes.size());
    if (!arrays) continue;
    absl::StatusOr<PackedLayout> layout = CheckPackedArrays(*arrays);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<Datum> halves(got->size());
    UnpackDatums(*arrays, *layout, halves.size() / 2, halves.size(), &halves);
    UnpackDatums(*arrays, *layout, 0, halves.size() / 2, &halves);
    for (size_t i = 0; i < halves.size(); ++i) {
      EXPECT_EQ(halves[i].tokens, (*got)[i].tokens);
      EXPECT_EQ(halves[i].target_tokens, (*got)[i].target_tokens);
      EXPECT_EQ(halves[i].advantages, (*got)[i].advantages);
    }
  }
}

TEST(PackedDatumsWireTest, ConvertsAndRefusesAsTheParsedMessageDoes) {
  const v1::PackedDatums packed = Packed({3, 5, 2}, 7);
  ExpectConvertsAsParsed(packed.SerializeAsString());
  // lengths as separate varints rather than packed, and a tokens array sent twice (the last
  // one counts, as protobuf keeps it).
  v1::PackedDatums arrays = Packed({2, 1}, 1);
  arrays.clear_lengths();
  v1::PackedDatums earlier;
  earlier.set_tokens(std::string(12, '\x7f'));
  ExpectConvertsAsParsed(std::string("\x08\x02\x08\x01", 4) + earlier.SerializeAsString() + arrays.SerializeAsString());
  // Refusals: an array of the wrong size, next-token targets of the wrong size, a negative length.
  v1::PackedDatums short_tokens = packed;
  short_tokens.mutable_tokens()->resize(8);
  ExpectConvertsAsParsed(short_tokens.SerializeAsString());
  v1::PackedDatums last_targets = packed;
  last_targets.clear_target_tokens();
  last_targets.set_last_target_tokens(std::string(8, '\0'));
  ExpectConvertsAsParsed(last_targets.SerializeAsString());
  v1::PackedDatums negative = packed;
  negative.set_lengths(1, -5);
  ExpectConvertsAsParsed(negative.SerializeAsString());
  // Unpacked datums beside packed ones are refused, as RequestDatums does.
  google::protobuf::RepeatedPtrField<v1::Datum> unpacked;
  unpacked.Add()->add_tokens(1);
  auto owner = std::make_shared<const std::string>(packed.SerializeAsString());
  absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read({*owner}, owner);
  ASSERT_TRUE(wire.ok());
  EXPECT_EQ(wire->Datums(unpacked).status(), RequestDatums(unpacked, packed).status());
  // Bytes that are not a PackedDatums message.
  for (const std::string& bad : {std::string("\x12\x05" "ab", 4), std::string("\x0a\x03\x80\x80", 4),
                                 std::string("\x08", 1)}) {
    EXPECT_EQ(PackedDatumsWire::Read({bad}, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(PackedWireFingerprintTest, ARequestHashesTheSameWithItsPackedDatumsLeftOnTheWire) {
  v1::TrainStepRequest full = Request();
  full.GetReflection()->MutableUnknownFields(&full)->AddVarint(50, 7);  // kept, and hashed after the known fields
  const std::string bytes = full.SerializeAsString();
  const std::string whole = RequestFingerprint(full);
  for (size_t piece : {size_t{7}, bytes.size()}) {
    auto owner = std::make_shared<const std::string>(bytes);
    absl::StatusOr<FieldCut> cut = ScanTopLevelFields(InPieces(*owner, piece), 9, kDatums);
    ASSERT_TRUE(cut.ok() && cut->cut);
    v1::TrainStepRequest stripped;
    ASSERT_TRUE(stripped.ParseFromString(cut->rest));
    absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read(cut->field, owner);
    ASSERT_TRUE(wire.ok());
    EXPECT_EQ(RequestFingerprint(stripped, PackedField{9, &*wire}), whole) << piece;
  }
  // Other datums hash differently.
  v1::TrainStepRequest other = full;
  *other.mutable_packed_datums() = Packed({3, 5, 2}, 8);
  auto owner = std::make_shared<const std::string>(other.packed_datums().SerializeAsString());
  absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read({*owner}, owner);
  ASSERT_TRUE(wire.ok());
  other.clear_packed_datums();
  EXPECT_NE(RequestFingerprint(other, PackedField{9, &*wire}), whole);
}

}  // namespace
}  // namespace lorastep
