// The gradient finalizer over a real gloo mesh of threads in one process: every replicated
// bucket of a dense LoRA adapter on tp2 x dp2 is reduced to the dense sum of its group's
// inputs (the same on every member), and a reduction skipped, doubled, or corrupted on one
// rank is refused on every rank, before any optimizer, with the parameters untouched.
#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/model/adapter.h"
#include "lib/model/model_config.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "lib/training/grad_faults.h"
#include "lib/training/grad_finalizer.h"
#include "tests/gloo_threads.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

struct RankResult {
  absl::Status status = absl::UnknownError("not run");
  double grad_norm = -1;
  std::vector<at::Tensor> inputs;   // each bucket before the finalizer (undefined: absent)
  std::vector<at::Tensor> outputs;  // and after
  bool parameters_unchanged = false;
};

// Rank r's gradient in bucket b: small multiples of 1/4, so every sum is exact in fp32.
at::Tensor FakeGradient(int rank, int bucket, int64_t n) {
  return (at::arange(n, at::kFloat).remainder(7) - 3 + bucket) * 0.25 * (rank + 1);
}

std::vector<RankResult> Finalize(const ParallelSizes& sizes, const GradFaultSpec& fault,
                                 const std::string& name) {
  const ModelConfig config = ModelConfigPreset("tiny").value();
  const ParallelLayout layout = ParallelLayout::Create(sizes, sizes.world()).value();
  std::vector<RankResult> results(sizes.world());
  const std::vector<absl::Status> formed = testing::RunOnGlooThreads(
      sizes, "grad_finalizer_" + name, [&](int r, ProcessGroups* groups) -> absl::Status {
      RankResult& out = results[r];
      const ModelShard shard = MakeModelShard(sizes, layout.Coords(r), config);
      LoraConfig lora;
      lora.rank = 4;
      auto adapter = Adapter::CreateLora(config, lora, at::kCPU, at::kFloat, 1, &shard);
      if (!adapter.ok()) {
        out.status = adapter.status();
        return absl::OkStatus();
      }
      for (int b = 0; b < kNumGradBuckets; ++b) {
        at::Tensor bucket = adapter->grad_bucket(static_cast<GradBucket>(b));
        if (bucket.defined()) bucket.copy_(FakeGradient(r, b, bucket.numel()));
        out.inputs.push_back(bucket.defined() ? bucket.clone() : at::Tensor());
      }
      std::vector<at::Tensor> before;
      for (const auto& p : adapter->parameters()) before.push_back(p.value.clone());
      GradFinalizeOptions options;
      options.expert_lora = false;
      options.faults = MakeGradFaults(fault);
      auto report = FinalizeStepGradients(&*adapter, groups, options);
      out.status = report.status();
      if (report.ok()) out.grad_norm = report->grad_norm;
      for (int b = 0; b < kNumGradBuckets; ++b) {
        const at::Tensor& bucket = adapter->grad_bucket(static_cast<GradBucket>(b));
        out.outputs.push_back(bucket.defined() ? bucket.clone() : at::Tensor());
      }
      out.parameters_unchanged = true;
      for (size_t i = 0; i < before.size(); ++i) {
        out.parameters_unchanged = out.parameters_unchanged && at::equal(before[i], adapter->parameters()[i].value);
      }
      return absl::OkStatus();
    });
  for (int r = 0; r < sizes.world(); ++r) {
    if (!formed[r].ok()) results[r].status = formed[r];
  }
  return results;
}

const ParallelSizes kTp2Dp2{2, 1, 2};

TEST(GradFinalizerTest, EveryReplicatedBucketBecomesItsGroupsDenseSum) {
  const ParallelLayout layout = ParallelLayout::Create(kTp2Dp2, 4).value();
  const auto results = Finalize(kTp2Dp2, {}, "sum");
  const std::pair<GradBucket, GroupKind> reduced[] = {{GradBucket::kReplicatedPartial, GroupKind::kStage},
                                                      {GradBucket::kSplit, GroupKind::kData}};
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].status.ok()) << "rank " << r << ": " << results[r].status;
    EXPECT_EQ(results[r].grad_norm, results[0].grad_norm) << "rank " << r << " clips by another norm";
    for (const auto& [bucket, kind] : reduced) {
      const int b = static_cast<int>(bucket);
      ASSERT_TRUE(results[r].outputs[b].defined()) << "bucket " << b << " absent on rank " << r;
      at::Tensor dense = at::zeros_like(results[r].inputs[b]);
      for (int member : layout.Group(kind, r)) dense += results[member].inputs[b];
      EXPECT_TRUE(at::equal(results[r].outputs[b], dense)) << "bucket " << b << " on rank " << r;
    }
  }
  EXPECT_GT(results[0].grad_norm, 0);
}

TEST(GradFinalizerTest, EachBucketSkippedDoubledOrCorruptedIsRefusedOnEveryRank) {
  for (const char* bucket : {"replicated_partial", "split"}) {
    for (const char* kind : {"skip", "double", "corrupt"}) {
      SCOPED_TRACE(std::string(bucket) + ":" + kind);
      GradFaultSpec fault;
      fault.bucket = bucket;
      fault.kind = kind;
      fault.rank = 1;  // corrupt: rank 1's sums only
      const auto results = Finalize(kTp2Dp2, fault, std::string(bucket) + "_" + kind);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(results[r].status.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": "
                                                                                   << results[r].status;
        EXPECT_TRUE(results[r].parameters_unchanged) << "rank " << r;
      }
    }
  }
}

// A rank whose plan of a bucket differs from its group's (a different set or order of
// parameters) is found before any gradient collective: every rank refuses, no bucket changed.
TEST(GradFinalizerTest, ADifferingReductionPlanIsRefusedBeforeAnyCollective) {
  for (const char* bucket : {"replicated_partial", "split"}) {
    SCOPED_TRACE(bucket);
    GradFaultSpec fault;
    fault.bucket = bucket;
    fault.kind = "plan";
    fault.rank = 2;
    const auto results = Finalize(kTp2Dp2, fault, std::string(bucket) + "_plan");
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(results[r].status.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r;
      EXPECT_NE(std::string(results[r].status.message()).find(std::string("reduction plan of the ") + bucket),
                std::string::npos)
          << results[r].status;
      for (int b = 0; b < kNumGradBuckets; ++b) {
        if (!results[r].inputs[b].defined()) continue;
        EXPECT_TRUE(at::equal(results[r].outputs[b], results[r].inputs[b])) << "bucket " << b << " on rank " << r;
      }
    }
  }
}

// A bucket fault shared through `once` strikes the first finalization that begins and no
// other; the shared-factor faults hold in every one.
TEST(GradFinalizerTest, AOnceFaultStrikesOnlyTheFirstFinalization) {
  GradFaultSpec spec;
  spec.bucket = "split";
  spec.kind = "skip";
  spec.skip_shared_family = "fc2";
  spec.once = std::make_shared<std::atomic<bool>>(false);
  const std::shared_ptr<FinalizeFaultSource> source = MakeGradFaults(spec);
  ASSERT_NE(source, nullptr);
  const std::unique_ptr<FinalizeFaults> first = source->Begin(0), second = source->Begin(0);
  EXPECT_EQ(first->Reductions("split"), 0);
  EXPECT_EQ(second->Reductions("split"), 1);
  EXPECT_EQ(first->Reductions("shared_fc2"), 0);
  EXPECT_EQ(second->Reductions("shared_fc2"), 0);
  EXPECT_EQ(second->Reductions("shared_fc1"), 1);
  EXPECT_EQ(MakeGradFaults(GradFaultSpec()), nullptr);
}

TEST(GradFinalizerTest, FaultTextIsCheckedNamingTheFlag) {
  GradFaultSpec spec;
  EXPECT_TRUE(ParseBucketFault("split:plan:1", "test_grad_fault", &spec).ok());
  EXPECT_EQ(spec.bucket, "split");
  EXPECT_EQ(spec.kind, "plan");
  EXPECT_EQ(spec.rank, 1);
  for (const char* bad : {"split:plan", "split:corrupt:-1", "nothing:skip", "split:twice"}) {
    GradFaultSpec unchanged;
    const absl::Status parsed = ParseBucketFault(bad, "test_grad_fault", &unchanged);
    EXPECT_TRUE(absl::IsInvalidArgument(parsed)) << bad;
    EXPECT_NE(std::string(parsed.message()).find("test_grad_fault"), std::string::npos) << bad;
    EXPECT_TRUE(unchanged.empty()) << bad;
  }
}

}  // namespace
}  // namespace lorastep
