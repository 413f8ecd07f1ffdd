#include "lib/parallel/context_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/torch_status.h"
#include "lib/torch_compat.h"

namespace lorastep {

std::vector<int64_t> ContextShardTokens(const std::vector<int64_t>& lengths, int cp, int rank) {
  std::vector<int64_t> out;
  const int64_t chunks = 2 * static_cast<int64_t>(cp);
  int64_t start = 0;
  for (int64_t n : lengths) {
    // Chunk c spans [begin(c), begin(c + 1)): the first n % chunks chunks one token longer.
    auto begin = [&](int64_t c) { return c * (n / chunks) + std::min(c, n % chunks); };
    for (int64_t c : {static_cast<int64_t>(rank), chunks - 1 - rank}) {
      for (int64_t i = begin(c); i < begin(c + 1); ++i) out.push_back(start + i);
    }
    start += n;
  }
  return out;
}

ContextShare MakeContextShare(const std::vector<int64_t>& lengths, int cp, int rank) {
  ContextShare share;
  std::vector<int64_t> sequence_of;  // packed position -> sequence
  for (size_t s = 0; s < lengths.size(); ++s) sequence_of.insert(sequence_of.end(), lengths[s], static_cast<int64_t>(s));
  for (int r = 0; r < cp; ++r) {
    std::vector<int64_t> held = ContextShardTokens(lengths, cp, r);
    share.counts.push_back(static_cast<int64_t>(held.size()));
    share.gather_order.insert(share.gather_order.end(), held.begin(), held.end());
    if (r == rank) share.tokens = std::move(held);
  }
  for (int64_t t : share.tokens) share.sequence_ids.push_back(sequence_of[t]);
  return share;
}

namespace {

int64_t GroupToken(CommGroup* g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(g)); }
CommGroup* GroupFromToken(int64_t t) { return reinterpret_cast<CommGroup*>(static_cast<intptr_t>(t)); }

// Every rank's rows padded to the largest count, all-gathered, padding dropped.
at::Tensor Gathered(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& counts) {
  int64_t most = 0;
  for (int64_t c : counts) most = std::max(most, c);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = most;
  at::Tensor padded = at::zeros(shape, x.options());
  padded.narrow(0, 0, x.size(0)).copy_(x);
  auto parts = group->AllGather(padded);
  ThrowIfError(parts.status());
  std::vector<at::Tensor> rows;
  for (size_t j = 0; j < parts->size(); ++j) rows.push_back((*parts)[j].narrow(0, 0, counts[j]));
  return at::cat(rows, 0);
}

class GatherContextRowsFunction : public torch::autograd::Function<GatherContextRowsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, CommGroup* group,
                            std::vector<int64_t> counts) {
    ctx->saved_data["group"] = GroupToken(group);
    ctx->saved_data["counts"] = c10::List<int64_t>(counts);
    return Gathered(x, group, counts);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    CommGroup* group = GroupFromToken(ctx->saved_data["group"].toInt());
    const c10::List<int64_t> counts = ctx->saved_data["counts"].toIntList();
    // Every rank's contribution to every row, summed; then this rank's rows.
    at::Tensor sum = grads[0].contiguous().clone();
    ThrowIfError(group->AllReduce(sum));
    int64_t start = 0;
    for (int j = 0; j < group->rank(); ++j) start += counts[j];
    return {sum.narrow(0, start, counts[group->rank()]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor GatherContextRows(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& counts) {
  if (group == nullptr || group->size() == 1) return x;
  return GatherContextRowsFunction::apply(x, group, counts);
}

at::Tensor GatherContextShares(const at::Tensor& x, CommGroup* group, const ContextShare& share) {
  at::NoGradGuard no_grad;
  const at::Tensor in_rank_order = GatherContextRows(x, group, share.counts);
  const at::Tensor order = at::tensor(share.gather_order, at::kLong).to(x.device());
  return at::empty_like(in_rank_order).index_copy_(0, order, in_rank_order);
}

at::Tensor ContextParallelAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& seq, const at::Tensor& pos, CommGroup* group,
                                    const std::vector<int64_t>& counts, int64_t window, const at::Tensor& sinks) {
  const at::Tensor k_all = GatherContextRows(k, group, counts), v_all = GatherContextRows(v, group, counts);
  at::Tensor seq_all, pos_all;
  {
    at::NoGradGuard no_grad;
    seq_all = GatherContextRows(seq, group, counts);
    pos_all = GatherContextRows(pos, group, counts);
  }
  const int64_t heads = q.size(1), groups = heads / k.size(1), d = q.size(2);
  // [heads, t, d] x [heads, d, total] in fp32, K/V heads shared by `groups` query heads.
  const at::Tensor qh = q.transpose(0, 1).to(at::kFloat);
  const at::Tensor kh = k_all.transpose(0, 1).to(at::kFloat).repeat_interleave(groups, 0);
  const at::Tensor vh = v_all.transpose(0, 1).to(at::kFloat).repeat_interleave(groups, 0);
  at::Tensor scores = at::matmul(qh, kh.transpose(1, 2)) / std::sqrt(static_cast<double>(d));
  at::Tensor allowed = seq.unsqueeze(1).eq(seq_all.unsqueeze(0)) & pos_all.unsqueeze(0).le(pos.unsqueeze(1));
  if (window > 0) allowed = allowed & pos_all.unsqueeze(0).gt(pos.unsqueeze(1) - window);
  scores = scores.masked_fill(allowed.logical_not().unsqueeze(0), -std::numeric_limits<float>::infinity());
  const at::Tensor probs = compat::SoftmaxWithSink(scores, sinks.defined() ? sinks.view({heads, 1, 1}) : sinks);
  return at::matmul(probs, vh).transpose(0, 1).to(q.scalar_type());
}

}  // namespace lorastep
