#include "lib/parallel/parallel_layout.h"

#include <set>

#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;
using ::testing::ElementsAre;

TEST(ParallelLayoutTest, MegatronOrderTensorFastest) {
  ASSERT_OK_AND_ASSIGN(ParallelLayout l, ParallelLayout::Create({2, 2, 2}, 8));
  EXPECT_EQ(l.Coords(0), (RankCoords{0, 0, 0}));
  EXPECT_EQ(l.Coords(1), (RankCoords{1, 0, 0}));
  EXPECT_EQ(l.Coords(2), (RankCoords{0, 0, 1}));
  EXPECT_EQ(l.Coords(5), (RankCoords{1, 1, 0}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.Rank(l.Coords(r)), r);
  EXPECT_THAT(l.Group(GroupKind::kTensor, 5), ElementsAre(4, 5));
  EXPECT_THAT(l.Group(GroupKind::kData, 5), ElementsAre(5, 7));
  EXPECT_THAT(l.Group(GroupKind::kPipeline, 5), ElementsAre(1, 5));
  EXPECT_THAT(l.Group(GroupKind::kStage, 5), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(l.Group(GroupKind::kModelParallel, 5), ElementsAre(0, 1, 4, 5));
  EXPECT_EQ(l.Groups(GroupKind::kTensor).size(), 4u);
  EXPECT_EQ(l.GroupIndex(GroupKind::kStage, 5), 1);
  EXPECT_TRUE(l.IsLastStage(5));
  EXPECT_TRUE(l.IsFirstStage(3));
}

// Context ranks sit between tensor and data ranks (Megatron's tp-cp-dp-pp order); their
// gradients reduce with the data replicas' (the data group holds dp x cp ranks).
TEST(ParallelLayoutTest, ContextRanksBetweenTensorAndData) {
  ParallelSizes sizes{2, 1, 2};
  sizes.cp = 2;
  ASSERT_OK_AND_ASSIGN(ParallelLayout l, ParallelLayout::Create(sizes, 8));
  RankCoords five{1, 0, 1};  // tp 1, pp 0, dp 1, cp 0
  EXPECT_EQ(l.Coords(5), five);
  RankCoords seven = five;
  seven.cp = 1;
  EXPECT_EQ(l.Coords(7), seven);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.Rank(l.Coords(r)), r);
  EXPECT_THAT(l.Group(GroupKind::kTensor, 5), ElementsAre(4, 5));
  EXPECT_THAT(l.Group(GroupKind::kContext, 5), ElementsAre(5, 7));
  EXPECT_THAT(l.Group(GroupKind::kData, 5), ElementsAre(1, 3, 5, 7));
  EXPECT_THAT(l.Group(GroupKind::kModelParallel, 5), ElementsAre(4, 5));
  EXPECT_THAT(l.Group(GroupKind::kPipeline, 5), ElementsAre(5));
  EXPECT_EQ(l.Group(GroupKind::kStage, 5).size(), 8u);
  EXPECT_EQ(l.ToString(), "tp2 x pp1 x dp2 x cp2");
  for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kContext, GroupKind::kModelParallel}) {
    std::multiset<int> seen;
    for (const auto& g : l.Groups(kind)) seen.insert(g.begin(), g.end());
    EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), 8u) << GroupKindName(kind);
    EXPECT_EQ(seen.size(), 8u) << GroupKindName(kind);
  }
  sizes.cp = 0;
  EXPECT_THAT(ParallelLayout::Create(sizes, 0), StatusIs(absl::StatusCode::kInvalidArgument, "cp: must be >= 1"));
  sizes.cp = 2;
  sizes.ep = 2;
  EXPECT_THAT(ParallelLayout::Create(sizes, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, "cp: context parallelism (cp 2) with expert parallelism"));
  sizes.ep = 1;
  EXPECT_THAT(ParallelLayout::Create(sizes, 4), StatusIs(absl::StatusCode::kInvalidArgument, "tp * pp * dp * cp"));
}

TEST(ParallelLayoutTest, GroupsPartitionTheWorld) {
  ASSERT_OK_AND_ASSIGN(ParallelLayout l, ParallelLayout::Create({2, 3, 2}, 12));
  for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline,
                         GroupKind::kStage, GroupKind::kModelParallel, GroupKind::kWorld}) {
    std::multiset<int> seen;
    for (const auto& g : l.Groups(kind)) seen.insert(g.begin(), g.end());
    EXPECT_EQ(seen.size(), 12u) << GroupKindName(kind);
    EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), 12u) << GroupKindName(kind);
  }
  EXPECT_EQ(l.Groups(GroupKind::kData)[0].size(), 2u);
  EXPECT_EQ(l.Groups(GroupKind::kPipeline)[0].size(), 3u);
}

TEST(ParallelLayoutTest, InvalidSizesNameTheFlag) {
  EXPECT_THAT(ParallelLayout::Create({2, 2, 2}, 6), StatusIs(absl::StatusCode::kInvalidArgument, "world_size"));
  EXPECT_THAT(ParallelLayout::Create({0, 1, 1}, 0), StatusIs(absl::StatusCode::kInvalidArgument, "tp:"));
  EXPECT_THAT(ParallelLayout::Create({1, -1, 1}, 1), StatusIs(absl::StatusCode::kInvalidArgument, "pp:"));
  EXPECT_THAT(ParallelLayout::Create({1, 1, 0}, 0), StatusIs(absl::StatusCode::kInvalidArgument, "dp:"));
}

TEST(ParallelLayoutTest, ModelChecks) {
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelConfigPreset("tiny"));  // 4 heads, 2 KV, 2 layers
  EXPECT_TRUE(ValidateLayoutForModel({2, 2, 2}, c).ok());
  EXPECT_TRUE(ValidateLayoutForModel({4, 1, 1}, c).ok());  // KV heads replicated
  EXPECT_THAT(ValidateLayoutForModel({3, 1, 1}, c),
              StatusIs(absl::StatusCode::kInvalidArgument, "tp: 3 does not divide num_attention_heads"));
  EXPECT_THAT(ValidateLayoutForModel({1, 3, 1}, c),
              StatusIs(absl::StatusCode::kInvalidArgument, "pp: 3 exceeds num_hidden_layers"));
  c.intermediate_size = 66;
  EXPECT_THAT(ValidateLayoutForModel({4, 1, 1}, c),
              StatusIs(absl::StatusCode::kInvalidArgument, "intermediate_size"));
  // Context parallelism takes sliding windows and attention sinks (its mask has both).
  ParallelSizes cp2;
  cp2.cp = 2;
  EXPECT_TRUE(ValidateLayoutForModel(cp2, ModelConfigPreset("tiny-qwen2-swa").value()).ok());
  EXPECT_TRUE(ValidateLayoutForModel(cp2, ModelConfigPreset("tiny-gpt-oss").value()).ok());
}

// Expert parallelism is carved out of the data axis (ep_rank = dp_rank % ep).
TEST(ParallelLayoutTest, ExpertGroupsInsideTheDataAxis) {
  ASSERT_OK_AND_ASSIGN(ParallelLayout l, ParallelLayout::Create({2, 1, 4, 2}, 8));
  // tp fastest: rank = tp + 2 * dp; ep = dp % 2.
  EXPECT_EQ(l.Coords(6).ep, 1);  // dp 3
  EXPECT_THAT(l.Group(GroupKind::kExpert, 0), ElementsAre(0, 2));      // dp 0, 1
  EXPECT_THAT(l.Group(GroupKind::kExpert, 4), ElementsAre(4, 6));      // dp 2, 3
  EXPECT_THAT(l.Group(GroupKind::kExpertData, 0), ElementsAre(0, 4));  // same experts
  EXPECT_THAT(l.Group(GroupKind::kExpertStage, 3), ElementsAre(2, 3, 6, 7));
  EXPECT_EQ(l.ToString(), "tp2 x pp1 x dp4, ep2");
  EXPECT_THAT(ParallelLayout::Create({1, 1, 4, 3}, 4), StatusIs(absl::StatusCode::kInvalidArgument, "ep: must be >= 1 and divide dp 4"));
  ASSERT_OK_AND_ASSIGN(ModelConfig dense, ModelConfigPreset("tiny"));
  EXPECT_THAT(ValidateLayoutForModel({1, 1, 2, 2}, dense), StatusIs(absl::StatusCode::kInvalidArgument, "ep: 2 needs a MoE model"));
  ASSERT_OK_AND_ASSIGN(ModelConfig moe, ModelConfigPreset("tiny-moe"));  // 4 experts
  EXPECT_TRUE(ValidateLayoutForModel({2, 1, 4, 4}, moe).ok());
  EXPECT_THAT(ValidateLayoutForModel({1, 1, 3, 3}, moe), StatusIs(absl::StatusCode::kInvalidArgument, "ep: 3 does not divide num_experts 4"));
  const ModelShard s = MakeModelShard({2, 1, 4, 2}, l.Coords(3), moe);  // tp 1, dp 1 -> ep 1
  EXPECT_EQ(s.expert_begin, 2);
  EXPECT_EQ(s.expert_end, 4);
  EXPECT_EQ(s.moe_ffn_begin, moe.moe.moe_intermediate_size / 2);
  EXPECT_EQ(s.shared_ffn_end, moe.moe.shared_expert_intermediate_size);
}

// The seed's group selection: TP4 x PP2. A shared expert factor reduces over its stage's
// tensor+data group; any rank set crossing the pipeline axis is refused.
TEST(ParallelLayoutTest, SharedFactorGroupNeverCrossesThePipelineAxis) {
  ASSERT_OK_AND_ASSIGN(ParallelLayout l, ParallelLayout::Create({4, 2, 1}, 8));
  for (int r = 0; r < 8; ++r) {
    const std::vector<int> g = SharedFactorGroup(l, r);
    ASSERT_EQ(g.size(), 4u);
    for (int m : g) EXPECT_EQ(l.Coords(m).pp, l.Coords(r).pp);
    EXPECT_TRUE(SharedFactorGroupCheck(l, g).ok());
  }
  EXPECT_THAT(SharedFactorGroup(l, 5), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(SharedFactorGroupCheck(l, l.Group(GroupKind::kPipeline, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "{1,5} crosses the pipeline axis"));
  EXPECT_THAT(SharedFactorGroupCheck(l, l.Group(GroupKind::kModelParallel, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "crosses the pipeline axis"));
  EXPECT_THAT(SharedFactorGroupCheck(l, l.Group(GroupKind::kWorld, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "rank 0 is on stage 0, rank 4 on stage 1"));
  EXPECT_THAT(SharedFactorGroupCheck(l, {3, 9}), StatusIs(absl::StatusCode::kFailedPrecondition, "outside the mesh"));
}

TEST(ParallelLayoutTest, ShardsCoverTheModel) {
  ASSERT_OK_AND_ASSIGN(ModelConfig c, ModelConfigPreset("tiny"));
  c.num_hidden_layers = 5;
  c.vocab_size = 97;
  int64_t layers = 0, vocab = 0;
  for (int pp = 0; pp < 2; ++pp) {
    ModelShard s = MakeModelShard({2, 2, 1}, {0, pp, 0}, c);
    EXPECT_EQ(s.layer_begin, layers);
    layers = s.layer_end;
  }
  EXPECT_EQ(layers, 5);
  for (int tp = 0; tp < 2; ++tp) {
    ModelShard s = MakeModelShard({2, 1, 1}, {tp, 0, 0}, c);
    EXPECT_EQ(s.vocab_begin, vocab);
    vocab = s.vocab_end;
    EXPECT_EQ(s.heads, 2);
    EXPECT_EQ(s.head_begin, 2 * tp);
    EXPECT_EQ(s.kv_heads, 1);
    EXPECT_EQ(s.kv_head_begin, tp);
    EXPECT_EQ(s.ffn_end - s.ffn_begin, 32);
  }
  EXPECT_EQ(vocab, 97);
  // tp 4 > 2 KV heads: every rank holds both (replicated); ranks 0,1 read head 0, 2,3 head 1.
  const ModelShard r1 = MakeModelShard({4, 1, 1}, {1, 0, 0}, c);
  EXPECT_TRUE(r1.kv_replicated);
  EXPECT_EQ(r1.kv_heads, 2);
  EXPECT_EQ(r1.kv_select, 0);
  EXPECT_EQ(MakeModelShard({4, 1, 1}, {2, 0, 0}, c).kv_select, 1);
  EXPECT_TRUE(LinearSplitOf(r1, 1, c).replicated);
  EXPECT_EQ(LinearSplitOf(r1, 1, c).end, 2 * c.head_dim());
  EXPECT_FALSE(LinearSplitOf(MakeModelShard({2, 1, 1}, {1, 0, 0}, c), 1, c).replicated);
  EXPECT_TRUE(MakeModelShard({1, 1, 4}, {0, 0, 3}, c).whole());
}

}  // namespace
}  // namespace lorastep
