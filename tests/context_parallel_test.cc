// Context-parallel building blocks over a real gloo group of threads in one process: the
// load-balanced split of packed sequences, and causal attention across the split, whose
// outputs and q/k/v gradients on every rank equal those rows of plain causal attention over
// each whole sequence.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/model/adapter.h"
#include "lib/model/model_weights.h"
#include "lib/model/qwen2.h"
#include "lib/parallel/context_parallel.h"
#include "lib/training/grad_finalizer.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "tests/gloo_threads.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

TEST(ContextShardTokensTest, EveryTokenOnceEarlyAndLateChunksPaired) {
  const std::vector<int64_t> lengths{10, 3, 8, 1};
  for (int cp : {1, 2, 3}) {
    std::multiset<int64_t> seen;
    for (int r = 0; r < cp; ++r) {
      const std::vector<int64_t> mine = ContextShardTokens(lengths, cp, r);
      EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end())) << cp << " " << r;
      seen.insert(mine.begin(), mine.end());
    }
    EXPECT_EQ(seen.size(), 22u) << cp;
    for (int64_t i = 0; i < 22; ++i) EXPECT_EQ(seen.count(i), 1u) << cp << " token " << i;
  }
  // cp 2: 10 tokens in chunks 3, 3, 2, 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  const std::vector<int64_t> r0 = ContextShardTokens({10}, 2, 0), r1 = ContextShardTokens({10}, 2, 1);
  EXPECT_EQ(r0, (std::vector<int64_t>{0, 1, 2, 8, 9}));
  EXPECT_EQ(r1, (std::vector<int64_t>{3, 4, 5, 6, 7}));
}

// Plain causal attention of each whole sequence: q [T, heads, d], k/v [T, kv, d] packed.
at::Tensor ReferenceAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::vector<int64_t>& lengths) {
  std::vector<at::Tensor> out;
  int64_t start = 0;
  const int64_t groups = q.size(1) / k.size(1);
  for (int64_t n : lengths) {
    const at::Tensor qs = q.narrow(0, start, n).transpose(0, 1);
    const at::Tensor ks = k.narrow(0, start, n).transpose(0, 1).repeat_interleave(groups, 0);
    const at::Tensor vs = v.narrow(0, start, n).transpose(0, 1).repeat_interleave(groups, 0);
    at::Tensor s = at::matmul(qs, ks.transpose(1, 2)) / std::sqrt(static_cast<double>(q.size(2)));
    s = s.masked_fill(at::ones({n, n}, at::kBool).triu(1), -std::numeric_limits<float>::infinity());
    out.push_back(at::matmul(at::softmax(s, -1), vs).transpose(0, 1));
    start += n;
  }
  return at::cat(out, 0);
}

struct RankOut {
  at::Tensor out, dq, dk, dv;
  std::vector<int64_t> tokens;
};

TEST(ContextParallelAttentionTest, EveryRankMatchesWholeSequenceAttention) {
  const std::vector<int64_t> lengths{7, 12, 5, 2};
  const int64_t total = 26, heads = 4, kv = 2, d = 8;
  at::manual_seed(3);
  const at::Tensor q = at::randn({total, heads, d}), k = at::randn({total, kv, d}), v = at::randn({total, kv, d});
  const at::Tensor g = at::randn({total, heads, d});
  std::vector<int64_t> seq_ids, positions;
  for (size_t s = 0; s < lengths.size(); ++s) {
    for (int64_t i = 0; i < lengths[s]; ++i) seq_ids.push_back(static_cast<int64_t>(s)), positions.push_back(i);
  }
  const at::Tensor seq = at::tensor(seq_ids, at::kLong), pos = at::tensor(positions, at::kLong);
  // The reference and its gradients.
  at::Tensor rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true), rv = v.clone().requires_grad_(true);
  const at::Tensor want = ReferenceAttention(rq, rk, rv, lengths);
  (want * g).sum().backward();

  for (int cp : {2, 3}) {
    ParallelSizes sizes;
    sizes.tp = cp;  // a group of cp ranks; attention only uses the group
    std::vector<int64_t> counts;
    for (int r = 0; r < cp; ++r) counts.push_back(static_cast<int64_t>(ContextShardTokens(lengths, cp, r).size()));
    std::vector<RankOut> results(cp);
    const std::vector<absl::Status> status = testing::RunOnGlooThreads(
        sizes, "context_parallel_" + std::to_string(cp), [&](int r, ProcessGroups* groups) -> absl::Status {
          RankOut& o = results[r];
          o.tokens = ContextShardTokens(lengths, cp, r);
          const at::Tensor idx = at::tensor(o.tokens, at::kLong);
          at::Tensor lq = q.index_select(0, idx).requires_grad_(true);
          at::Tensor lk = k.index_select(0, idx).requires_grad_(true);
          at::Tensor lv = v.index_select(0, idx).requires_grad_(true);
          o.out = ContextParallelAttention(lq, lk, lv, seq.index_select(0, idx), pos.index_select(0, idx),
                                           &groups->group(GroupKind::kTensor), counts);
          (o.out * g.index_select(0, idx)).sum().backward();
          o.out = o.out.detach();
          o.dq = lq.grad(), o.dk = lk.grad(), o.dv = lv.grad();
          return absl::OkStatus();
        });
    for (int r = 0; r < cp; ++r) {
      const RankOut& o = results[r];
      ASSERT_TRUE(status[r].ok()) << "cp " << cp << " rank " << r << ": " << status[r];
      const at::Tensor idx = at::tensor(o.tokens, at::kLong);
      const std::string what = "cp " + std::to_string(cp) + " rank " + std::to_string(r);
      EXPECT_LT(testing::RelErr(o.out, want.detach().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dq, rq.grad().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dk, rk.grad().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dv, rv.grad().index_select(0, idx)), 1e-6) << what;
    }
  }
}

// The decoder layers over context ranks (PackedSequences::context_group): each rank's hidden
// states are those rows of the whole sequences' forward, and the LoRA gradients summed over
// the ranks are the whole forward's (dense and MoE layers; RoPE by each token's position; a
// sliding-window layer, and gpt-oss's sinks with its window).
TEST(ContextParallelAttentionTest, LayersOverContextRanksMatchTheWholeSequences) {
  const std::vector<int64_t> lengths{7, 12, 5};
  const int64_t total = 24;
  for (const char* preset : {"tiny", "tiny-moe", "tiny-qwen2-swa", "tiny-gpt-oss"}) {
    const ModelConfig c = ModelConfigPreset(preset).value();
    ModelWeights w = RandomModelWeights(c, 5);
    for (LayerWeights& l : w.layers) {
      if (l.sinks.defined()) l.sinks = at::randn(l.sinks.sizes()) * 2;  // sinks of a visible size
    }
    PackProjections(&w);
    LoraConfig lora;
    lora.rank = 4;
    lora.target_modules = {"all-linear"};
    auto make_adapter = [&] {
      Adapter a = Adapter::CreateLora(c, lora, at::kCPU, at::kFloat, 3).value();
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
      at::NoGradGuard no_grad;
      for (Parameter& p : a.parameters()) {
        if (p.name.find("lora_B") != std::string::npos) p.value.normal_(0.0, 0.1, gen);
      }
      return a;
    };
    at::manual_seed(4);
    const at::Tensor tokens = at::randint(0, c.vocab_size, {1, total}, at::kLong);
    const at::Tensor g = at::randn({1, total, c.hidden_size});
    PackedSequences whole;
    whole.lengths = lengths;
    whole.max_length = 12;
    whole.cu_seqlens = at::tensor(std::vector<int32_t>{0, 7, 19, 24}, at::kInt);
    std::vector<int64_t> seq_ids, positions;
    for (size_t s = 0; s < lengths.size(); ++s) {
      for (int64_t i = 0; i < lengths[s]; ++i) seq_ids.push_back(static_cast<int64_t>(s)), positions.push_back(i);
    }
    whole.positions = at::tensor(positions, at::kLong);
    Adapter want_adapter = make_adapter();
    ForwardOptions want_options;
    want_options.packed = &whole;
    const at::Tensor want = Qwen2Hidden(c, w, &want_adapter, tokens, want_options);
    (want * g).sum().backward();
    ASSERT_OK(FoldLocalGradients(&want_adapter));

    const int cp = 2;
    ParallelSizes sizes;
    sizes.tp = cp;
    std::vector<int64_t> counts;
    for (int r = 0; r < cp; ++r) counts.push_back(static_cast<int64_t>(ContextShardTokens(lengths, cp, r).size()));
    std::vector<at::Tensor> hidden(cp);
    std::vector<Adapter> adapters;
    for (int r = 0; r < cp; ++r) adapters.push_back(make_adapter());
    const std::vector<absl::Status> status = testing::RunOnGlooThreads(
        sizes, std::string("context_layers_") + preset, [&](int r, ProcessGroups* groups) -> absl::Status {
          const at::Tensor idx = at::tensor(ContextShardTokens(lengths, cp, r), at::kLong);
          PackedSequences mine = whole;
          mine.positions = whole.positions.index_select(0, idx);
          mine.sequence_ids = at::tensor(seq_ids, at::kLong).index_select(0, idx);
          mine.context_group = &groups->group(GroupKind::kTensor);
          mine.context_counts = counts;
          ForwardOptions options;
          options.packed = &mine;
          at::Tensor h = Qwen2Hidden(c, w, &adapters[r], tokens.index_select(1, idx), options);
          (h * g.index_select(1, idx)).sum().backward();
          hidden[r] = h.detach();
          return FoldLocalGradients(&adapters[r]);
        });
    for (int r = 0; r < cp; ++r) {
      ASSERT_TRUE(status[r].ok()) << preset << " rank " << r << ": " << status[r];
      const at::Tensor idx = at::tensor(ContextShardTokens(lengths, cp, r), at::kLong);
      EXPECT_LT(testing::RelErr(hidden[r], want.detach().index_select(1, idx)), 1e-6) << preset << " rank " << r;
    }
    for (size_t i = 0; i < want_adapter.parameters().size(); ++i) {
      const Parameter& p = want_adapter.parameters()[i];
      if (p.main_grad.abs().max().item<double>() == 0) continue;  // an expert no token reached
      const at::Tensor summed = adapters[0].parameters()[i].main_grad + adapters[1].parameters()[i].main_grad;
      EXPECT_LT(testing::RelErr(summed, p.main_grad), 1e-5) << preset << " " << p.name;
    }
  }
}

}  // namespace
}  // namespace lorastep
