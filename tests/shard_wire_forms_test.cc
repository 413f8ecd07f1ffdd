// ShardWireForms: every rank of a data-parallel replica sends its shard in the form the first
// one built, and that form is built once however many ranks ask at the same time. CallBatch:
// a packed batch for a run's one worker that takes it as sent is passed on unread, in the
// bytes it came in.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/proto_convert.h"
#include "server/batch_split.h"
#include "server/worker_client.h"

namespace lorastep {
namespace {

TEST(ShardWireFormsTest, EachShardIsBuiltOnceForAllItsRanks) {
  ShardWireForms wire(2);
  std::atomic<int> built[2] = {0, 0};
  std::vector<const ShardWireForms::Form*> seen(8);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 8; ++rank) {
    ranks.emplace_back([&, rank] {
      const size_t shard = rank % 2;
      seen[rank] = &wire.Get(shard, [&](ShardWireForms::Form* form) {
        ++built[shard];
        form->packed.set_tokens(std::string(4 * (shard + 1), 'x'));
      });
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(built[0].load(), 1);
  EXPECT_EQ(built[1].load(), 1);
  for (int rank = 0; rank < 8; ++rank) {
    EXPECT_EQ(seen[rank], seen[rank % 2]) << rank;
    EXPECT_EQ(seen[rank]->packed.tokens().size(), 4u * (rank % 2 + 1)) << rank;
  }
}

v1::PackedDatums PackedBatch(const std::vector<int>& lengths) {
  std::vector<v1::Datum> datums;
  for (int length : lengths) {
    v1::Datum& d = datums.emplace_back();
    for (int i = 0; i < length; ++i) {
      d.add_tokens(i);
      d.add_target_tokens(i + 1);
    }
  }
  v1::PackedDatums packed;
  EXPECT_TRUE(PackDatums(datums, &packed));
  return packed;
}

// `packed` as a request's field arrives: its bytes, in pieces of `piece` bytes.
PackedDatumsWire OnTheWire(const v1::PackedDatums& packed, size_t piece) {
  auto bytes = std::make_shared<const std::string>(packed.SerializeAsString());
  WirePieces pieces;
  for (size_t at = 0; at < bytes->size(); at += piece) pieces.push_back(absl::string_view(*bytes).substr(at, piece));
  absl::StatusOr<PackedDatumsWire> wire = PackedDatumsWire::Read(pieces, bytes);
  EXPECT_TRUE(wire.ok()) << wire.status();
  return *std::move(wire);
}

TEST(CallBatchTest, APackedBatchForOneWorkerIsPassedOnUnread) {
  const BatchSplit one_worker{ParallelLayout()};
  v1::PackedDatums packed = PackedBatch({3, 5});
  packed.mutable_tokens()->resize(4);  // malformed: the worker's parse names it, not this
  const PackedDatumsWire wire = OnTheWire(packed, 7);
  const google::protobuf::RepeatedPtrField<v1::Datum> none;
  absl::StatusOr<CallBatch> as_sent = CallBatch::Read(none, v1::PackedDatums(), &wire, /*as_sent=*/true);
  ASSERT_TRUE(as_sent.ok()) << as_sent.status();
  EXPECT_FALSE(as_sent->parsed());
  EXPECT_EQ(as_sent->num_datums(), 2);
  EXPECT_EQ(as_sent->num_targets(), 8);
  ASSERT_TRUE(as_sent->Split(one_worker).ok());
  const auto deadline = std::chrono::system_clock::now();
  const BatchShard shard = as_sent->ShardOfRank(one_worker, 0, deadline);
  EXPECT_EQ(shard.as_sent, &wire);
  EXPECT_EQ(shard.datums, nullptr);
  EXPECT_EQ(shard.deadline, deadline);
  // Parsed: when the worker does not take it as sent (from the wire, contiguous or in
  // pieces, or from a parsed request), and always for datums sent one by one.
  absl::StatusOr<CallBatch> parsed = CallBatch::Read(none, v1::PackedDatums(), &wire, /*as_sent=*/false);
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("packed_datums.tokens"), std::string::npos) << parsed.status();
  const v1::PackedDatums good = PackedBatch({3, 5});
  for (size_t piece : {size_t{5}, size_t{1} << 20}) {
    const PackedDatumsWire good_wire = OnTheWire(good, piece);
    parsed = CallBatch::Read(none, v1::PackedDatums(), &good_wire, /*as_sent=*/false);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_TRUE(parsed->parsed());
    ASSERT_EQ(parsed->num_datums(), 2);
    EXPECT_EQ(parsed->datums()[1].target_tokens, (std::vector<int64_t>{1, 2, 3, 4, 5})) << piece;
  }
  parsed = CallBatch::Read(none, good, nullptr, /*as_sent=*/true);  // packed in the message: parsed
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->parsed());
  EXPECT_EQ(parsed->num_datums(), 2);
  EXPECT_EQ(parsed->num_targets(), 8);
  ASSERT_TRUE(parsed->Split(one_worker).ok());
  const BatchShard whole = parsed->ShardOfRank(one_worker, 0, deadline);
  EXPECT_EQ(whole.as_sent, nullptr);
  ASSERT_NE(whole.indices, nullptr);
  EXPECT_EQ(*whole.indices, (std::vector<int>{0, 1}));
  google::protobuf::RepeatedPtrField<v1::Datum> one_by_one;
  one_by_one.Add()->add_tokens(1);
  one_by_one.Mutable(0)->add_target_tokens(2);
  absl::StatusOr<CallBatch> repeated = CallBatch::Read(one_by_one, v1::PackedDatums(), nullptr, /*as_sent=*/true);
  ASSERT_TRUE(repeated.ok()) << repeated.status();
  EXPECT_TRUE(repeated->parsed());
  EXPECT_EQ(repeated->num_targets(), 1);
  // An empty batch is counted, not passed on: Split refuses it on a mesh, the worker alone.
  const PackedDatumsWire empty_wire = OnTheWire(v1::PackedDatums(), 8);
  absl::StatusOr<CallBatch> empty = CallBatch::Read(none, v1::PackedDatums(), &empty_wire, /*as_sent=*/true);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->parsed());
  EXPECT_EQ(empty->num_datums(), 0);
}

}  // namespace
}  // namespace lorastep
