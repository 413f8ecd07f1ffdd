#include "lib/sampling/kv_blocks.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lorastep {

int64_t KvBlockPool::BytesPerBlock(const KvShape& shape, at::ScalarType dtype) {
  return 2 * shape.layers * shape.block_size * shape.kv_heads * shape.head_dim *
         static_cast<int64_t>(at::elementSize(dtype));
}

absl::StatusOr<KvBlockPool> KvBlockPool::Create(const KvShape& shape, int64_t blocks, at::ScalarType dtype,
                                                at::Device device) {
  if (shape.layers < 1 || shape.kv_heads < 1 || shape.head_dim < 1) {
    return absl::InvalidArgumentError("kv cache: layers, kv_heads and head_dim must be >= 1");
  }
  if (shape.block_size < 1 || shape.block_size > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_size: ", shape.block_size, " is not in [1, 4096]"));
  }
  if (blocks < 1 || blocks > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: ", blocks, " blocks is not in [1, 2^30]"));
  }
  KvBlockPool pool;
  pool.shape_ = shape;
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  // Uninitialized: attention reads only positions a forward wrote (and on CPU untouched
  // pages cost nothing until a sequence reaches them).
  for (int64_t l = 0; l < shape.layers; ++l) {
    pool.keys_.push_back(at::empty({blocks * shape.block_size, shape.kv_heads, shape.head_dim}, options));
    pool.values_.push_back(at::empty({blocks * shape.block_size, shape.kv_heads, shape.head_dim}, options));
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
  const at::Device device = pool->keys(pool->shape().first_layer).device();
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
  if (decoding.empty()) return;
  // The decoding sequences' slots as one [S, longest] table (padding: slot 0, masked).
  std::vector<int64_t> rows, table, padding;
  std::vector<int64_t> first_row(sequences.size() + 1, 0);
  for (size_t s = 0; s < sequences.size(); ++s) first_row[s + 1] = first_row[s] + new_tokens[s];
  for (int64_t s : decoding) {
    const int64_t end = sequences[s]->length + 1;
    std::vector<int64_t> slots = Slots(*sequences[s], 0, end, bs);
    slots.resize(longest, 0);
    table.insert(table.end(), slots.begin(), slots.end());
    for (int64_t p = 0; p < longest; ++p) padding.push_back(p >= end ? 1 : 0);
    rows.push_back(first_row[s]);
  }
  decode_sequences_ = decoding;
  decode_rows_ = at::tensor(rows, at::kLong).to(device);
  decode_slots_ = at::tensor(table, at::kLong).view({static_cast<int64_t>(decoding.size()), longest}).to(device);
  decode_padding_ = at::tensor(padding, at::kLong).view({static_cast<int64_t>(decoding.size()), longest}).to(at::kBool).to(device);
}

at::Tensor KvStepAttention::Attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  at::NoGradGuard no_grad;
  at::Tensor& keys = pool_->keys(layer);
  at::Tensor& values = pool_->values(layer);
  keys.index_copy_(0, write_slots_, k[0].to(keys.scalar_type()));
  values.index_copy_(0, write_slots_, v[0].to(values.scalar_type()));
  const int64_t heads = q.size(2), kv_heads = k.size(2), d = q.size(3), group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> outs(new_tokens_.size());
  // Decoding sequences (one new token each) attend together: their keys and values gathered
  // into [S, L, kv_heads, d] (L: the longest; the padding masked out), each key/value head
  // against its group of query heads, without repeating it.
  if (decode_rows_.defined()) {
    const int64_t n = decode_rows_.size(0), longest = decode_slots_.size(1);
    const at::Tensor qd = q[0].index_select(0, decode_rows_).to(at::kFloat).view({n, kv_heads, group, d});
    const at::Tensor kd = keys.index_select(0, decode_slots_.reshape({-1})).to(at::kFloat).view({n, longest, kv_heads, d});
    const at::Tensor vd = values.index_select(0, decode_slots_.reshape({-1})).to(at::kFloat).view({n, longest, kv_heads, d});
    at::Tensor scores = at::matmul(qd, kd.permute({0, 2, 3, 1})) * scale;  // [S, kv_heads, group, L]
    scores = scores.masked_fill(decode_padding_.view({n, 1, 1, longest}), -std::numeric_limits<float>::infinity());
    const at::Tensor out = at::matmul(at::softmax(scores, -1), vd.permute({0, 2, 1, 3}));  // [S, kv_heads, group, d]
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
    scores = scores.masked_fill(key_pos.unsqueeze(0) > query_pos.unsqueeze(1), -std::numeric_limits<float>::infinity());
    const at::Tensor out = at::matmul(at::softmax(scores, -1), vs.transpose(0, 1));  // [heads, n, d]
    outs[s] = out.transpose(0, 1).reshape({n, heads * d});
    row += n;
  }
  return at::cat(outs, 0).to(q.scalar_type()).unsqueeze(0);
}

}  // namespace lorastep
