// The pipeline-stage gather (lib/training/stage_gather.h): over a real gloo group of three
// stages, stage 0 receives every stage's tensors, bitwise, in stage order, whatever their
// dtypes; a malformed wire form is refused by name, never read past its bytes.
#include "lib/training/stage_gather.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "tests/gloo_threads.h"

namespace lorastep {
namespace {

// Values that differ by stage, made without the global generator (the ranks are threads).
std::vector<NamedTensor> StageTensors(int stage) {
  const at::Tensor a = at::arange(15, at::kFloat).reshape({3, 5}) * (stage + 1.5) - 0.3;
  return {{"stage" + std::to_string(stage) + ".a", a},
          {"stage" + std::to_string(stage) + ".b", (a.narrow(1, 0, 2).narrow(0, 0, 2) / 7).to(at::kBFloat16)},
          {"stage" + std::to_string(stage) + ".steps", at::arange(stage + 1, at::kLong)},
          {"stage" + std::to_string(stage) + ".empty", at::zeros({0, 4})}};
}

TEST(StageGatherTest, StageZeroReceivesEveryStageInOrderBitwise) {
  ParallelSizes sizes;
  sizes.pp = 3;
  std::vector<std::vector<NamedTensor>> gathered(3);
  auto status = testing::RunOnGlooThreads(sizes, "stage_gather", [&](int rank, ProcessGroups* groups) -> absl::Status {
    auto all = GatherStagesToFirst(groups->group(GroupKind::kPipeline), StageTensors(rank), at::Device(at::kCPU));
    if (!all.ok()) return all.status();
    gathered[rank] = *all;
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  std::vector<NamedTensor> want;
  for (int stage = 0; stage < 3; ++stage) {
    for (auto& t : StageTensors(stage)) want.push_back(t);
  }
  ASSERT_EQ(gathered[0].size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(gathered[0][i].first, want[i].first);
    EXPECT_EQ(gathered[0][i].second.scalar_type(), want[i].second.scalar_type()) << want[i].first;
    EXPECT_TRUE(gathered[0][i].second.sizes().equals(want[i].second.sizes())) << want[i].first;
    EXPECT_TRUE(at::equal(gathered[0][i].second, want[i].second)) << want[i].first;
  }
  EXPECT_EQ(gathered[1].size(), 4u) << "a later stage keeps its own list";
  EXPECT_EQ(gathered[1][0].first, "stage1.a");
}

TEST(StageGatherTest, MalformedWireFormIsRefusedByName) {
  const PackedTensors packed = PackTensors(StageTensors(1));
  auto round = UnpackTensors(packed.header, packed.bytes.data(), packed.bytes.size());
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(round->size(), 4u);
  // Fewer bytes than the header promises.
  auto short_bytes = UnpackTensors(packed.header, packed.bytes.data(), packed.bytes.size() - 1);
  EXPECT_EQ(short_bytes.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(short_bytes.status().message().find("lie outside the"), std::string::npos) << short_bytes.status();
  // A header that is not an array, an entry without its fields, an unknown dtype, a size
  // that disagrees with the shape.
  EXPECT_EQ(UnpackTensors("{}", nullptr, 0).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(UnpackTensors("[{\"name\":\"x\"}]", nullptr, 0).status().message().find("lacks name, dtype"),
            std::string::npos);
  EXPECT_NE(UnpackTensors("[{\"name\":\"x\",\"dtype\":999,\"shape\":[1],\"offset\":0,\"nbytes\":4}]", "abcd", 4)
                .status()
                .message()
                .find("tensor 'x': unknown dtype 999"),
            std::string::npos);
  const int f32 = static_cast<int>(at::kFloat);
  EXPECT_NE(UnpackTensors("[{\"name\":\"x\",\"dtype\":" + std::to_string(f32) +
                              ",\"shape\":[2],\"offset\":0,\"nbytes\":4}]",
                          "abcdefgh", 8)
                .status()
                .message()
                .find("tensor 'x': its bytes do not match its shape"),
            std::string::npos);
  EXPECT_NE(UnpackTensors("[{\"name\":\"x\",\"dtype\":" + std::to_string(f32) +
                              ",\"shape\":[-1],\"offset\":0,\"nbytes\":4}]",
                          "abcd", 4)
                .status()
                .message()
                .find("tensor 'x': bad shape"),
            std::string::npos);
}

}  // namespace
}  // namespace lorastep
