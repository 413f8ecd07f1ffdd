// ShardWireForms: every rank of a data-parallel replica sends its shard in the form the first
// one built, and that form is built once however many ranks ask at the same time.
#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace lorastep
