// Helpers shared by the family tests (gpt-oss, Qwen3.5): a folder's tensors as stored, and
// the packed-row check.
#ifndef LORASTEP_TESTS_MODEL_TEST_UTIL_H_
#define LORASTEP_TESTS_MODEL_TEST_UTIL_H_

#include <algorithm>
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/model/qwen2.h"
#include "tests/torch_test_util.h"

namespace lorastep::testing {

// Every tensor of `folder`'s model.safetensors by name, in fp64, as stored.
inline std::map<std::string, at::Tensor> StoredTensors(const std::string& folder) {
  std::map<std::string, at::Tensor> out;
  SafetensorsFile file = SafetensorsFile::Open(folder + "/model.safetensors").value();
  for (const auto& e : file.entries()) out[e.name] = TensorFromEntry(e).value().to(at::kDouble);
  return out;
}

// Two random sequences (9 and 6 tokens) packed in one row give the hidden states each gives
// alone, within `tolerance`.
// Sequences of `lengths` packed back to back in one row, on `device`: their starts, positions
// within each sequence and longest length.
inline PackedSequences PackedSequencesOf(const std::vector<int64_t>& lengths, const at::Device& device = at::kCPU) {
  PackedSequences packed;
  packed.lengths = lengths;
  std::vector<int32_t> starts{0};
  std::vector<int64_t> positions;
  for (int64_t n : lengths) {
    starts.push_back(starts.back() + static_cast<int32_t>(n));
    packed.max_length = std::max(packed.max_length, n);
    for (int64_t i = 0; i < n; ++i) positions.push_back(i);
  }
  packed.cu_seqlens = at::tensor(starts, at::kInt).to(device);
  packed.positions = at::tensor(positions, at::kLong).to(device);
  return packed;
}

inline void ExpectPackedRowsEqualAlone(const ModelConfig& c, const ModelWeights& w, double tolerance) {
  const at::Tensor a = at::randint(c.vocab_size, {1, 9}, at::kLong), b = at::randint(c.vocab_size, {1, 6}, at::kLong);
  at::NoGradGuard no_grad;
  ForwardOptions alone;
  alone.training = false;
  const at::Tensor ha = Qwen2Hidden(c, w, nullptr, a, alone), hb = Qwen2Hidden(c, w, nullptr, b, alone);
  const PackedSequences packed = PackedSequencesOf({9, 6});
  ForwardOptions options = alone;
  options.packed = &packed;
  const at::Tensor h = Qwen2Hidden(c, w, nullptr, at::cat({a, b}, 1), options);
  EXPECT_LT(MaxAbsDiff(h.narrow(1, 0, 9), ha), tolerance);
  EXPECT_LT(MaxAbsDiff(h.narrow(1, 9, 6), hb), tolerance);
}

}  // namespace lorastep::testing

#endif  // LORASTEP_TESTS_MODEL_TEST_UTIL_H_
