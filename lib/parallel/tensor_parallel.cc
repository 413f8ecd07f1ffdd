#include "lib/parallel/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include "lib/torch_status.h"

namespace lorastep {
namespace {

// A CommGroup* travels as a plain value (autograd ignores non-tensor arguments) and sits in
// saved_data as an integer.
int64_t GroupToken(CommGroup* g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(g)); }
CommGroup* GroupFromToken(int64_t t) { return reinterpret_cast<CommGroup*>(static_cast<intptr_t>(t)); }

at::Tensor AllReduced(const at::Tensor& x, CommGroup* group) {
  at::Tensor out = x.contiguous().clone();
  ThrowIfError(group->AllReduce(out));
  return out;
}

class CopyToRegion : public torch::autograd::Function<CopyToRegion> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, CommGroup* group) {
    ctx->saved_data["group"] = GroupToken(group);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {AllReduced(grads[0], GroupFromToken(ctx->saved_data["group"].toInt())), at::Tensor()};
  }
};

class ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x, CommGroup* group) {
    return AllReduced(x, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

at::Tensor Exchanged(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& in,
                     const std::vector<int64_t>& out) {
  auto result = group->AllToAll(x, in, out);
  ThrowIfError(result.status());
  return *result;
}

class AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, CommGroup* group,
                            std::vector<int64_t> in, std::vector<int64_t> out) {
    ctx->saved_data["group"] = GroupToken(group);
    ctx->saved_data["in"] = c10::List<int64_t>(in);
    ctx->saved_data["out"] = c10::List<int64_t>(out);
    return Exchanged(x, group, in, out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    CommGroup* group = GroupFromToken(ctx->saved_data["group"].toInt());
    const std::vector<int64_t> in = ctx->saved_data["in"].toIntVector();
    const std::vector<int64_t> out = ctx->saved_data["out"].toIntVector();
    return {Exchanged(grads[0], group, out, in), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool Trivial(CommGroup* group) { return group == nullptr || group->size() == 1; }

}  // namespace

at::Tensor CopyToTensorRegion(const at::Tensor& x, CommGroup* group) {
  if (Trivial(group)) return x;
  return CopyToRegion::apply(x, group);
}

at::Tensor ReduceFromTensorRegion(const at::Tensor& x, CommGroup* group) {
  if (Trivial(group)) return x;
  return ReduceFromRegion::apply(x, group);
}

at::Tensor AllToAllRows(const at::Tensor& x, CommGroup* group, const std::vector<int64_t>& input_splits,
                        const std::vector<int64_t>& output_splits) {
  if (Trivial(group)) return x;
  return AllToAllFunction::apply(x, group, input_splits, output_splits);
}

at::Tensor VocabParallelEmbedding(const at::Tensor& weight, const at::Tensor& tokens,
                                  int64_t vocab_begin, CommGroup* group) {
  if (Trivial(group)) return at::embedding(weight, tokens);
  const int64_t rows = weight.size(0);
  at::Tensor local = tokens - vocab_begin;
  at::Tensor in_range = (local >= 0) & (local < rows);
  at::Tensor rows_used = at::where(in_range, local, at::zeros_like(local));
  at::Tensor emb = at::embedding(weight, rows_used) * in_range.unsqueeze(-1).to(weight.scalar_type());
  return ReduceFromTensorRegion(emb, group);
}

}  // namespace lorastep
