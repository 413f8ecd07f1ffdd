// Context-parallel building blocks over a real gloo group of threads in one process: the
// load-balanced split of packed sequences, and causal attention across the split, whose
// outputs and q/k/v gradients on every rank equal those rows of plain causal attention over
// each whole sequence.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "lib/parallel/context_parallel.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"

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
  absl::Status status = absl::UnknownError("not run");
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
    const ParallelLayout layout = ParallelLayout::Create(sizes, sizes.world()).value();
    const std::string store = "file://" + testing::ScratchDir("context_parallel_" + std::to_string(cp)) + "/store";
    std::vector<int64_t> counts;
    for (int r = 0; r < cp; ++r) counts.push_back(static_cast<int64_t>(ContextShardTokens(lengths, cp, r).size()));
    std::vector<RankOut> results(cp);
    std::vector<std::thread> ranks;
    for (int r = 0; r < cp; ++r) {
      ranks.emplace_back([&, r] {
        RankOut& o = results[r];
        ProcessGroupsOptions pg;
        pg.store_address = store;
        pg.rank = r;
        pg.layout = layout;
        pg.timeout = std::chrono::seconds(30);
        auto groups = ProcessGroups::Create(pg);
        if (!groups.ok()) {
          o.status = groups.status();
          return;
        }
        o.tokens = ContextShardTokens(lengths, cp, r);
        const at::Tensor idx = at::tensor(o.tokens, at::kLong);
        at::Tensor lq = q.index_select(0, idx).requires_grad_(true);
        at::Tensor lk = k.index_select(0, idx).requires_grad_(true);
        at::Tensor lv = v.index_select(0, idx).requires_grad_(true);
        try {
          o.out = ContextParallelAttention(lq, lk, lv, seq.index_select(0, idx), pos.index_select(0, idx),
                                           &(*groups)->group(GroupKind::kTensor), counts);
          (o.out * g.index_select(0, idx)).sum().backward();
          o.status = absl::OkStatus();
        } catch (const std::exception& e) {
          o.status = absl::InternalError(e.what());
        }
        o.out = o.out.defined() ? o.out.detach() : o.out;
        o.dq = lq.grad(), o.dk = lk.grad(), o.dv = lv.grad();
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < cp; ++r) {
      const RankOut& o = results[r];
      ASSERT_TRUE(o.status.ok()) << "cp " << cp << " rank " << r << ": " << o.status;
      const at::Tensor idx = at::tensor(o.tokens, at::kLong);
      const std::string what = "cp " + std::to_string(cp) + " rank " + std::to_string(r);
      EXPECT_LT(testing::RelErr(o.out, want.detach().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dq, rq.grad().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dk, rk.grad().index_select(0, idx)), 1e-6) << what;
      EXPECT_LT(testing::RelErr(o.dv, rv.grad().index_select(0, idx)), 1e-6) << what;
    }
  }
}

}  // namespace
}  // namespace lorastep
