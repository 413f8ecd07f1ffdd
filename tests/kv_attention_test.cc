// The sampler's cached attention (KvStepAttention) against a plain dense computation written
// here: for each sequence, its queries over every cached position up to their own, softmax in
// fp64. On CUDA with a head shape lorastep's paged decode kernel takes (head_dim 64 / 128 /
// 256, up to 8 query heads per key/value head), the decoding sequences go through the kernel,
// with long sequences split into parts; elsewhere through the ATen composition.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/sampling/kv_blocks.h"
#include "tests/torch_test_util.h"

namespace lorastep {
namespace {

using testing::TestDevice;
using testing::TestDtype;

struct Shape {
  int64_t kv_heads, group, head_dim, block_size;
};

// One forward's attention: `lengths[s]` cached positions, then `new_tokens[s]` new ones.
// `window` > 0: a sliding-window layer's (each query sees its last `window` positions).
// `sinks`: gpt-oss's sink logit per query head in each softmax's denominator.
void CheckAgainstDense(const Shape& shape, const std::vector<int64_t>& cached, const std::vector<int64_t>& fresh,
                       double tolerance, int64_t window = 0, bool sinks = false) {
  const at::Device device = TestDevice();
  const at::ScalarType dtype = TestDtype();
  const int64_t heads = shape.kv_heads * shape.group, d = shape.head_dim, n = static_cast<int64_t>(cached.size());
  KvShape kv;
  kv.layers = 1;
  kv.kv_heads = shape.kv_heads;
  kv.head_dim = d;
  kv.block_size = shape.block_size;
  kv.window = {window};
  int64_t blocks_needed = 0;
  for (int64_t s = 0; s < n; ++s) blocks_needed += (cached[s] + fresh[s] + shape.block_size - 1) / shape.block_size;
  absl::StatusOr<KvBlockPool> made = KvBlockPool::Create(kv, blocks_needed + 3, dtype, device);
  ASSERT_TRUE(made.ok()) << made.status();
  KvBlockPool pool = std::move(made).value();
  at::manual_seed(7);
  const auto opt = at::TensorOptions().dtype(dtype).device(device);
  // Every sequence's keys and values over all of its positions (the reference's input).
  std::vector<at::Tensor> all_k, all_v;
  std::vector<KvSequence> seqs(n);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t total = cached[s] + fresh[s];
    all_k.push_back(at::randn({total, shape.kv_heads, d}, opt));
    all_v.push_back(at::randn({total, shape.kv_heads, d}, opt));
    absl::StatusOr<std::vector<int32_t>> got = pool.Allocate(pool.BlocksFor(total));
    ASSERT_TRUE(got.ok());
    seqs[s].blocks = *got;
    // The blocks taken out of order, as a pool in use hands them out.
    std::reverse(seqs[s].blocks.begin(), seqs[s].blocks.end());
    for (int64_t p = 0; p < cached[s]; ++p) {
      const int64_t slot = seqs[s].blocks[p / shape.block_size] * shape.block_size + p % shape.block_size;
      pool.keys(0)[slot].copy_(all_k[s][p]);
      pool.values(0)[slot].copy_(all_v[s][p]);
    }
    seqs[s].length = cached[s];
  }
  std::vector<const KvSequence*> ptrs;
  std::vector<at::Tensor> qs, ks, vs;
  for (int64_t s = 0; s < n; ++s) {
    ptrs.push_back(&seqs[s]);
    qs.push_back(at::randn({fresh[s], heads, d}, opt));
    ks.push_back(all_k[s].narrow(0, cached[s], fresh[s]));
    vs.push_back(all_v[s].narrow(0, cached[s], fresh[s]));
  }
  const at::Tensor q = at::cat(qs, 0).unsqueeze(0), k = at::cat(ks, 0).unsqueeze(0), v = at::cat(vs, 0).unsqueeze(0);
  KvStepAttention attention(&pool, ptrs, fresh);
  const at::Tensor sink = sinks ? at::randn({heads}, opt) : at::Tensor();
  const at::Tensor out = attention.Attend(0, q, k, v, sink).to(at::kCPU, at::kDouble);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, q.size(1), heads * d}));
  int64_t row = 0;
  for (int64_t s = 0; s < n; ++s) {
    const at::Tensor qd = qs[s].to(at::kCPU, at::kDouble), kd = all_k[s].to(at::kCPU, at::kDouble),
                     vd = all_v[s].to(at::kCPU, at::kDouble);
    for (int64_t j = 0; j < fresh[s]; ++j) {
      const int64_t end = cached[s] + j + 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        const at::Tensor keys = kd.narrow(0, first, end - first).select(1, h / shape.group);  // [visible, d]
        const at::Tensor values = vd.narrow(0, first, end - first).select(1, h / shape.group);
        const at::Tensor scores = at::mv(keys, qd[j][h]) / std::sqrt(static_cast<double>(d));
        const at::Tensor probs =
            sinks ? at::softmax(at::cat({scores, sink[h].to(at::kCPU, at::kDouble).view({1})}), 0).narrow(0, 0, end - first)
                  : at::softmax(scores, 0);
        const at::Tensor want = at::mv(values.t(), probs);
        const at::Tensor got = out[0][row + j].narrow(0, h * d, d);
        ASSERT_LE(testing::MaxAbsDiff(got, want), tolerance)
            << "sequence " << s << " (" << cached[s] << " cached, " << fresh[s] << " new), query " << j << ", head " << h;
      }
    }
    row += fresh[s];
  }
}

double Tolerance() { return TestDtype() == at::kBFloat16 ? 2e-2 : 2e-5; }

TEST(KvAttentionTest, DecodeOfManySequencesEqualsDenseAttention) {
  // Grouped heads as Qwen2.5 has them (7 per key/value head), and one head per group.
  for (const Shape shape : {Shape{2, 7, 64, 16}, Shape{4, 1, 128, 16}, Shape{1, 8, 256, 8}, Shape{2, 2, 128, 32}}) {
    SCOPED_TRACE(::testing::Message() << "kv_heads " << shape.kv_heads << " group " << shape.group << " head_dim "
                                      << shape.head_dim << " block " << shape.block_size);
    CheckAgainstDense(shape, {0, 1, 15, 16, 17, 40, 63, 100}, std::vector<int64_t>(8, 1), Tolerance());
  }
}

// gpt-oss's attention sinks: decoding and prefill rows, full and sliding layers.
TEST(KvAttentionTest, SinksJoinEachSoftmax) {
  for (const int64_t window : {0, 5}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    CheckAgainstDense(Shape{2, 4, 64, 16}, {0, 3, 17, 40}, {1, 1, 1, 1}, Tolerance(), window, /*sinks=*/true);
    CheckAgainstDense(Shape{2, 4, 64, 16}, {0, 9, 2}, {7, 1, 12}, Tolerance(), window, /*sinks=*/true);
  }
}

TEST(KvAttentionTest, LongSequencesSplitIntoPartsEqualDenseAttention) {
  // Few sequences with thousands of positions: the kernel splits each into parts.
  CheckAgainstDense(Shape{2, 7, 128, 16}, {3000, 777}, {1, 1}, Tolerance());
  CheckAgainstDense(Shape{1, 4, 64, 16}, {4095}, {1}, Tolerance());
}

TEST(KvAttentionTest, SlidingWindowSeesOnlyTheLastPositions) {
  // Windows shorter and longer than the sequences, in decode (one part and split into parts)
  // and beside prompt chunks.
  CheckAgainstDense(Shape{2, 7, 64, 16}, {0, 1, 15, 16, 17, 40, 63, 100}, std::vector<int64_t>(8, 1), Tolerance(), 17);
  CheckAgainstDense(Shape{2, 7, 128, 16}, {3000, 777}, {1, 1}, Tolerance(), 1000);
  CheckAgainstDense(Shape{2, 7, 64, 16}, {20, 0, 33, 5, 300}, {1, 12, 1, 7, 1}, Tolerance(), 9);
  CheckAgainstDense(Shape{1, 4, 64, 8}, {50}, {1}, Tolerance(), 1);  // itself only
}

TEST(KvAttentionTest, DecodeBesidePromptChunksEqualsDenseAttention) {
  // Prompt chunks (several new tokens) between decoding sequences in one packed row.
  CheckAgainstDense(Shape{2, 7, 64, 16}, {20, 0, 33, 5, 300}, {1, 12, 1, 7, 1}, Tolerance());
}

}  // namespace
}  // namespace lorastep
