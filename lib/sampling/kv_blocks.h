// The sampler's key/value cache: fixed-size blocks in one pool per model shard, and the
// cached attention of one forward over them.
//
// The pool holds, per decoder layer, keys and values [blocks, block_size, kv_heads, head_dim]
// on the model's device, allocated once for a budget of blocks. A sequence holds a table of
// block ids (KvSequence); blocks are reference counted, so the samples of one prompt share
// the prompt's full blocks (prefix sharing) and copy only its last, partial one.
#ifndef LORASTEP_LIB_SAMPLING_KV_BLOCKS_H_
#define LORASTEP_LIB_SAMPLING_KV_BLOCKS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/model/qwen2.h"

namespace lorastep {

struct KvShape {
  int64_t layers = 0;      // decoder layers this shard holds
  int64_t first_layer = 0;  // global index of the first
  int64_t kv_heads = 0;    // this shard's key/value heads
  int64_t head_dim = 0;
  int64_t block_size = 16;  // positions per block
  // Per layer of this shard, the keys a query sees (ModelConfig::AttentionWindow; 0 or
  // absent: every position before it).
  std::vector<int64_t> window;
  // Per layer of this shard, whether it keeps keys and values (absent: every layer does; a
  // linear-attention layer does not).
  std::vector<bool> cached;
  bool Cached(int64_t layer) const {
    const int64_t i = layer - first_layer;
    return i < 0 || i >= static_cast<int64_t>(cached.size()) || cached[i];
  }
  int64_t CachedLayers() const {
    int64_t n = 0;
    for (int64_t l = first_layer; l < first_layer + layers; ++l) n += Cached(l) ? 1 : 0;
    return n;
  }
  int64_t WindowOf(int64_t layer) const {
    const int64_t i = layer - first_layer;
    return i >= 0 && i < static_cast<int64_t>(window.size()) ? window[i] : 0;
  }
};

// ModelConfig::AttentionWindow of layers [first_layer, first_layer + layers), for KvShape::window.
std::vector<int64_t> LayerWindows(const ModelConfig& config, int64_t first_layer, int64_t layers);

// The cache's shape for layers [first_layer, first_layer + layers) of `config` with
// `kv_heads` key/value heads per layer: their windows, and which of them keep keys and
// values (not the linear-attention layers, whose state is per sequence: RecurrentStateBytes).
KvShape KvShapeFor(const ModelConfig& config, int64_t first_layer, int64_t layers, int64_t kv_heads);

// Bytes one sequence's linear-attention state takes over those layers (the convolution's
// input history in `dtype`, the rule's state in fp32), with this tensor rank's heads
// (`shard`; null: all of them); 0 for a model without such layers.
int64_t RecurrentStateBytes(const ModelConfig& config, const ModelShard* shard, int64_t first_layer, int64_t layers,
                            at::ScalarType dtype);

// A sampling memory budget split between the pool's blocks and the sequences' recurrent
// states (`state_bytes` each): as many sequences of `typical_positions` positions (the
// worker: 2,048 or the model's length if shorter) fit in both, the rest of the budget in
// blocks. Without recurrent state, every byte is blocks.
struct SamplingBudget {
  int64_t blocks = 0;
  int64_t recurrent_sequences = 0;  // 0: no limit (no recurrent state)
};
SamplingBudget SplitSamplingBudget(int64_t bytes, int64_t bytes_per_block, int64_t block_size, int64_t state_bytes,
                                   int64_t typical_positions = 2048);

class KvBlockPool {
 public:
  // Bytes one block takes over the layers that keep keys and values.
  static int64_t BytesPerBlock(const KvShape& shape, at::ScalarType dtype);
  // A pool of `blocks` blocks; INVALID_ARGUMENT naming the field for a bad shape or count.
  static absl::StatusOr<KvBlockPool> Create(const KvShape& shape, int64_t blocks, at::ScalarType dtype,
                                            at::Device device);

  const KvShape& shape() const { return shape_; }
  int64_t total_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // Blocks that hold `positions` positions.
  int64_t BlocksFor(int64_t positions) const { return (positions + shape_.block_size - 1) / shape_.block_size; }

  // `n` fresh blocks (one reference each), or RESOURCE_EXHAUSTED with nothing taken.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t n);
  void Retain(int32_t block) { ++refs_[block]; }
  // Drops one reference; the block is free when none is left.
  void Release(int32_t block);
  int32_t references(int32_t block) const { return refs_[block]; }
  // Copies every layer's keys and values of block `from` into block `to`.
  void CopyBlock(int32_t from, int32_t to);

  const at::Device& device() const { return device_; }
  // Layer `layer` (global index) as [blocks * block_size, kv_heads, head_dim] (undefined for
  // a layer that keeps none).
  at::Tensor& keys(int64_t layer) { return keys_[layer - shape_.first_layer]; }
  at::Tensor& values(int64_t layer) { return values_[layer - shape_.first_layer]; }

 private:
  KvShape shape_;
  at::Device device_ = at::kCPU;
  std::vector<at::Tensor> keys_, values_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // free block ids, taken from the back
};

// One sequence's cache: its blocks, in position order, and how many positions they hold.
struct KvSequence {
  std::vector<int32_t> blocks;
  int64_t length = 0;
  // Linear-attention layers (Qwen3.5), by decoder layer: the convolution's input history and
  // the rule's state after `length` positions (RecurrentStates); empty until first written.
  std::map<int64_t, std::pair<at::Tensor, at::Tensor>> recurrent;
};

// The cached attention of one forward whose packed row holds, in order, `new_tokens[s]`
// tokens of each sequence s at positions sequences[s]->length onwards (their blocks must
// already cover those positions). Each layer's new keys and values are written into the
// blocks, then each sequence's new queries attend over all of its positions (a sliding layer's:
// the last KvShape::window of them), causally (fp32
// softmax, 1/sqrt(head_dim) scale; grouped-query heads share their key/value head). The
// sequences that decode (one new token) attend in one batched product; prompt chunks one by
// one. No grad. `sequences` outlive it (their blocks are read at the first layer).
class KvStepAttention : public CachedAttention {
 public:
  KvStepAttention(KvBlockPool* pool, const std::vector<const KvSequence*>& sequences,
                  const std::vector<int64_t>& new_tokens);
  at::Tensor Attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& sinks) override;

 private:
  KvBlockPool* pool_;
  std::vector<int64_t> starts_, new_tokens_;  // each sequence's first new position, and count
  at::Tensor write_slots_;                    // int64 [T]: the pool slot of each new token
  std::vector<at::Tensor> read_slots_;        // per sequence with several new tokens: its slots
  // The sequences with one new token (decoding), attended together: their indices and their
  // rows in the packed row; made at the first layer's Attend, by which of the two paths runs
  // it: lorastep's paged decode kernel (CUDA, a supported head shape, no sinks) reads the pool through
  // a block table and lengths, the ATen composition gathers their slots [S, longest] and
  // masks the padding.
  // kernel_allowed: the query and cache dtypes agree and the layer has no sinks.
  void PrepareDecode(int64_t group, bool kernel_allowed);
  std::vector<const KvSequence*> decode_seqs_;  // each decoding sequence (its blocks)
  std::vector<int64_t> decode_sequences_, decode_lengths_;
  int64_t decode_longest_ = 0;
  bool decode_prepared_ = false, decode_kernel_ = false;
  at::Tensor decode_rows_, decode_slots_, decode_padding_;
  at::Tensor decode_lengths_on_device_;  // int64 [S]: the ATen composition's masks
  at::Tensor decode_table_;  // int32: the lengths [S], then the block table [S, blocks]
  int64_t decode_table_stride_ = 0;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_SAMPLING_KV_BLOCKS_H_
