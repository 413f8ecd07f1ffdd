#include "lib/sampling/kv_blocks.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lib/torch_compat.h"

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/kernel_launch.h"
#include "lib/kernels/paged_decode.h"
#endif

namespace lorastep {

std::vector<int64_t> LayerWindows(const ModelConfig& config, int64_t first_layer, int64_t layers) {
  std::vector<int64_t> out;
  for (int64_t l = first_layer; l < first_layer + layers; ++l) out.push_back(config.AttentionWindow(l));
  return out;
}

KvShape KvShapeFor(const ModelConfig& config, int64_t first_layer, int64_t layers, int64_t kv_heads) {
  KvShape shape;
  shape.layers = layers;
  shape.first_layer = first_layer;
  shape.kv_heads = kv_heads;
  shape.head_dim = config.head_dim();
  shape.window = LayerWindows(config, first_layer, layers);
  for (int64_t l = first_layer; l < first_layer + layers; ++l) shape.cached.push_back(!config.IsLinearAttentionLayer(l));
  return shape;
}

int64_t RecurrentStateBytes(const ModelConfig& config, const ModelShard* shard, int64_t first_layer, int64_t layers,
                            at::ScalarType dtype) {
  const LinearAttentionConfig la = LocalLinearAttention(config, shard);
  const int64_t per_layer = (la.conv_kernel - 1) * la.conv_dim() * static_cast<int64_t>(at::elementSize(dtype)) +
                            la.num_value_heads * la.key_head_dim * la.value_head_dim * 4;
  int64_t bytes = 0;
  for (int64_t l = first_layer; l < first_layer + layers; ++l) bytes += config.IsLinearAttentionLayer(l) ? per_layer : 0;
  return bytes;
}

SamplingBudget SplitSamplingBudget(int64_t bytes, int64_t bytes_per_block, int64_t block_size, int64_t state_bytes,
                                   int64_t typical_positions) {
  SamplingBudget budget;
  if (state_bytes <= 0) {
    budget.blocks = bytes / bytes_per_block;
    return budget;
  }
  const int64_t blocks_per_sequence = (typical_positions + block_size - 1) / block_size;
  budget.recurrent_sequences = bytes / (blocks_per_sequence * bytes_per_block + state_bytes);
  // A budget short of one typical sequence still serves one shorter one.
  if (budget.recurrent_sequences < 1 && bytes >= state_bytes + bytes_per_block) budget.recurrent_sequences = 1;
  budget.blocks = (bytes - budget.recurrent_sequences * state_bytes) / bytes_per_block;
  return budget;
}

int64_t KvBlockPool::BytesPerBlock(const KvShape& shape, at::ScalarType dtype) {
  return 2 * shape.CachedLayers() * shape.block_size * shape.kv_heads * shape.head_dim *
         static_cast<int64_t>(at::elementSize(dtype));
}

absl::StatusOr<KvBlockPool> KvBlockPool::Create(const KvShape& shape, int64_t blocks, at::ScalarType dtype,
                                                at::Device device) {
  if (shape.layers < 1 || shape.kv_heads < 1 || shape.head_dim < 1) {
    return absl::InvalidArgumentError("kv cache: layers, kv_heads and head_dim must be >= 1");
  }
  if (shape.CachedLayers() < 1) {
    return absl::InvalidArgumentError("kv cache: no layer of this shard keeps keys and values");
  }
  if (shape.block_size < 1 || shape.block_size > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size: ", shape.block_size, " is not in [1, 4096]"));
  }
  if (blocks < 1 || blocks > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: ", blocks, " blocks is not in [1, 2^30]"));
  }
  KvBlockPool pool;
  pool.shape_ = shape;
  pool.device_ = device;
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  // Uninitialized: attention reads only positions a forward wrote (and on CPU untouched
  // pages cost nothing until a sequence reaches them). None for a layer that keeps none.
  for (int64_t l = 0; l < shape.layers; ++l) {
    const bool cached = shape.Cached(shape.first_layer + l);
    pool.keys_.push_back(cached ? at::empty({blocks * shape.block_size, shape.kv_heads, shape.head_dim}, options)
                                : at::Tensor());
    pool.values_.push_back(cached ? at::empty({blocks * shape.block_size, shape.kv_heads, shape.head_dim}, options)
                                  : at::Tensor());
  }
  pool.refs_.assign(blocks, 0);
  for (int64_t b = blocks - 1; b >= 0; --b) pool.free_.push_back(static_cast<int32_t>(b));
  return pool;
}

absl::StatusOr<std::vector<int32_t>> KvBlockPool::Allocate(int64_t n) {
  if (n > free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("kv cache: ", n, " blocks wanted, ", free_blocks(), " of ",
                                                     total_blocks(), " free"));
  }
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
    refs_[out.back()] = 1;
  }
  return out;
}

void KvBlockPool::Release(int32_t block) {
  if (--refs_[block] == 0) free_.push_back(block);
}

void KvBlockPool::CopyBlock(int32_t from, int32_t to) {
  const int64_t bs = shape_.block_size;
  for (size_t l = 0; l < keys_.size(); ++l) {
    if (!keys_[l].defined()) continue;
    keys_[l].narrow(0, to * bs, bs).copy_(keys_[l].narrow(0, from * bs, bs));
    values_[l].narrow(0, to * bs, bs).copy_(values_[l].narrow(0, from * bs, bs));
  }
}

namespace {

// The pool slots of positions [begin, end) of `seq`.
std::vector<int64_t> Slots(const KvSequence& seq, int64_t begin, int64_t end, int64_t block_size) {
  std::vector<int64_t> out;
  out.reserve(end - begin);
  for (int64_t p = begin; p < end; ++p) out.push_back(seq.blocks[p / block_size] * block_size + p % block_size);
  return out;
}

}  // namespace

KvStepAttention::KvStepAttention(KvBlockPool* pool, const std::vector<const KvSequence*>& sequences,
                                 const std::vector<int64_t>& new_tokens)
    : pool_(pool), new_tokens_(new_tokens) {
  const int64_t bs = pool->shape().block_size;
  const at::Device device = pool->device();
  std::vector<int64_t> writes, decoding;
  int64_t longest = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const KvSequence& seq = *sequences[s];
    starts_.push_back(seq.length);
    const int64_t end = seq.length + new_tokens[s];
    TORCH_CHECK(pool->BlocksFor(end) <= static_cast<int64_t>(seq.blocks.size()),
                "KvStepAttention: a sequence's blocks do not cover its new positions");
    const std::vector<int64_t> fresh = Slots(seq, seq.length, end, bs);
    writes.insert(writes.end(), fresh.begin(), fresh.end());
    if (new_tokens[s] == 1) {
      decoding.push_back(static_cast<int64_t>(s));
      longest = std::max(longest, end);
      read_slots_.emplace_back();
    } else {
      read_slots_.push_back(at::tensor(Slots(seq, 0, end, bs), at::kLong).to(device));
    }
  }
  write_slots_ = at::tensor(writes, at::kLong).to(device);
  for (int64_t s : decoding) {
    decode_sequences_.push_back(s);
    decode_lengths_.push_back(sequences[s]->length + 1);
    decode_seqs_.push_back(sequences[s]);
  }
  decode_longest_ = longest;
  // The decoding sequences' rows in the packed row.
  std::vector<int64_t> rows;
  int64_t row = 0;
  for (size_t s = 0, d = 0; s < sequences.size(); ++s) {
    if (d < decoding.size() && decoding[d] == static_cast<int64_t>(s)) {
      rows.push_back(row);
      ++d;
    }
    row += new_tokens[s];
  }
  if (!rows.empty()) decode_rows_ = at::tensor(rows, at::kLong).to(device);
}

void KvStepAttention::PrepareDecode(int64_t group, bool kernel_allowed) {
  decode_prepared_ = true;
  if (decode_sequences_.empty()) return;
  const int64_t bs = pool_->shape().block_size, n = static_cast<int64_t>(decode_sequences_.size());
  const at::Device device = pool_->device();
#ifdef LORASTEP_WITH_CUDA_KERNELS
  decode_kernel_ = kernel_allowed && device.is_cuda() && kernels::PagedDecodeSupported(group, pool_->shape().head_dim);
  if (decode_kernel_) {  // lengths, then each sequence's blocks padded to the longest list
    decode_table_stride_ = pool_->BlocksFor(decode_longest_);
    at::Tensor host = at::zeros({n + n * decode_table_stride_},
                                at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    int32_t* h = host.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      h[i] = static_cast<int32_t>(decode_lengths_[i]);
      const std::vector<int32_t>& blocks = decode_seqs_[i]->blocks;
      const int64_t used = std::min<int64_t>(pool_->BlocksFor(decode_lengths_[i]), static_cast<int64_t>(blocks.size()));
      std::copy(blocks.begin(), blocks.begin() + used, h + n + i * decode_table_stride_);
    }
    decode_table_ = host.to(device, /*non_blocking=*/true);
    return;
  }
#else
  (void)group;
  (void)kernel_allowed;
#endif
  // The ATen composition: the slots as one [S, longest] table (padding: slot 0, masked).
  std::vector<int64_t> table;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> slots = Slots(*decode_seqs_[i], 0, decode_lengths_[i], bs);
    slots.resize(decode_longest_, 0);
    table.insert(table.end(), slots.begin(), slots.end());
  }
  decode_slots_ = at::tensor(table, at::kLong).view({n, decode_longest_}).to(device);
  decode_lengths_on_device_ = at::tensor(decode_lengths_, at::kLong).to(device);
  const at::Tensor pos = at::arange(decode_longest_, decode_lengths_on_device_.options());
  decode_padding_ = pos.unsqueeze(0) >= decode_lengths_on_device_.unsqueeze(1);
}

at::Tensor KvStepAttention::Attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& sinks) {
  at::NoGradGuard no_grad;
  at::Tensor& keys = pool_->keys(layer);
  at::Tensor& values = pool_->values(layer);
  keys.index_copy_(0, write_slots_, k[0].to(keys.scalar_type()));
  values.index_copy_(0, write_slots_, v[0].to(values.scalar_type()));
  const int64_t heads = q.size(2), kv_heads = k.size(2), d = q.size(3), group = heads / kv_heads;
  const int64_t window = pool_->shape().WindowOf(layer);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> outs(new_tokens_.size());
  // Decoding sequences (one new token each) attend together, each key/value head against its
  // group of query heads without repeating it: through the paged kernel, or with their keys
  // and values gathered into [S, L, kv_heads, d] (L: the longest; the padding masked out).
  if (!decode_prepared_) PrepareDecode(group, q.scalar_type() == keys.scalar_type() && !sinks.defined());
  // gpt-oss's sinks (one more logit per query head in each softmax), laid out for the scores.
  auto softmax = [&](const at::Tensor& scores, at::IntArrayRef sink_shape) {
    return compat::SoftmaxWithSink(scores, sinks.defined() ? sinks.view(sink_shape) : sinks);
  };
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (decode_kernel_) {
    const bool all_decode = decode_sequences_.size() == new_tokens_.size();  // rows 0..S-1 in order
    const int64_t n = decode_rows_.size(0);
    const at::Tensor qd = (all_decode ? q[0] : q[0].index_select(0, decode_rows_)).contiguous();  // [S, heads, d]
    at::Tensor out = at::empty_like(qd);
    const kernels::PagedDecodePlan plan = kernels::PlanPagedDecode(n, kv_heads, group, d, decode_longest_);
    at::Tensor workspace;
    if (plan.workspace_floats > 0) workspace = at::empty({plan.workspace_floats}, qd.options().dtype(at::kFloat));
    const kernels::KernelLaunch launch(qd);
    kernels::CheckLaunch(
        kernels::LaunchPagedDecode(qd.data_ptr(), keys.data_ptr(), values.data_ptr(), kernels::ElementTypeOf(qd),
                                   decode_table_.data_ptr<int32_t>() + n, decode_table_stride_,
                                   decode_table_.data_ptr<int32_t>(), n, kv_heads, group, d,
                                   pool_->shape().block_size, window, static_cast<float>(scale), plan,
                                   workspace.defined() ? workspace.data_ptr<float>() : nullptr, out.data_ptr(),
                                   launch.stream),
        "paged decode");
    const at::Tensor rows = out.view({n, heads * d});
    if (all_decode) return rows.unsqueeze(0);
    for (int64_t i = 0; i < n; ++i) outs[decode_sequences_[i]] = rows.narrow(0, i, 1);
  } else
#endif
  if (decode_rows_.defined()) {
    const int64_t n = decode_rows_.size(0), longest = decode_slots_.size(1);
    const at::Tensor qd = q[0].index_select(0, decode_rows_).to(at::kFloat).view({n, kv_heads, group, d});
    const at::Tensor kd = keys.index_select(0, decode_slots_.reshape({-1})).to(at::kFloat).view({n, longest, kv_heads, d});
    const at::Tensor vd = values.index_select(0, decode_slots_.reshape({-1})).to(at::kFloat).view({n, longest, kv_heads, d});
    at::Tensor scores = at::matmul(qd, kd.permute({0, 2, 3, 1})) * scale;  // [S, kv_heads, group, L]
    at::Tensor hidden = decode_padding_;
    if (window > 0) {  // a sliding layer: positions before each sequence's last `window` too
      const at::Tensor pos = at::arange(longest, decode_lengths_on_device_.options());
      hidden = hidden.logical_or(pos.unsqueeze(0) < (decode_lengths_on_device_ - window).unsqueeze(1));
    }
    scores = scores.masked_fill(hidden.view({n, 1, 1, longest}), -std::numeric_limits<float>::infinity());
    const at::Tensor out = at::matmul(softmax(scores, {1, kv_heads, group, 1}), vd.permute({0, 2, 1, 3}));  // [S, kv_heads, group, d]
    const at::Tensor rows = out.reshape({n, heads * d});
    for (int64_t i = 0; i < n; ++i) outs[decode_sequences_[i]] = rows.narrow(0, i, 1);
  }
  int64_t row = 0;
  for (size_t s = 0; s < new_tokens_.size(); ++s) {
    const int64_t n = new_tokens_[s], length = starts_[s] + n;
    if (outs[s].defined()) {
      row += n;
      continue;
    }
    // [heads, n, d] queries over [heads, length, d] keys and values (GQA: each key/value head
    // serves `group` query heads).
    const at::Tensor qs = q[0].narrow(0, row, n).transpose(0, 1).to(at::kFloat);
    const at::Tensor ks = keys.index_select(0, read_slots_[s]).to(at::kFloat).repeat_interleave(group, 1);
    const at::Tensor vs = values.index_select(0, read_slots_[s]).to(at::kFloat).repeat_interleave(group, 1);
    at::Tensor scores = at::matmul(qs, ks.permute({1, 2, 0})) * scale;  // [heads, n, length]
    // Query j sits at position starts_[s] + j and sees positions up to it.
    const at::Tensor query_pos = at::arange(starts_[s], length, at::TensorOptions().dtype(at::kLong).device(q.device()));
    const at::Tensor key_pos = at::arange(length, at::TensorOptions().dtype(at::kLong).device(q.device()));
    at::Tensor hidden = key_pos.unsqueeze(0) > query_pos.unsqueeze(1);
    if (window > 0) hidden = hidden.logical_or(key_pos.unsqueeze(0) <= query_pos.unsqueeze(1) - window);
    scores = scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
    const at::Tensor out = at::matmul(softmax(scores, {heads, 1, 1}), vs.transpose(0, 1));  // [heads, n, d]
    outs[s] = out.transpose(0, 1).reshape({n, heads * d});
    row += n;
  }
  return at::cat(outs, 0).to(q.scalar_type()).unsqueeze(0);
}

}  // namespace lorastep
