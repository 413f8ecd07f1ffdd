// gpt-oss's stored routed-expert tensors against lorastep's expert layout.
// Stored (what transformers reads and writes): gate_up_proj [E, H, 2I] with gate and up in
// alternate columns (gate at even, up at odd), gate_up_proj_bias [E, 2I] alike, down_proj
// [E, I, H], down_proj_bias [E, H]. lorastep's: experts_gate_up [E, 2I, H] with the gate rows
// first, then the up rows (as every MoE family here), its bias [E, 2I] alike,
// experts_down [E, H, I], its bias [E, H].
#ifndef LORASTEP_LIB_MODEL_GPT_OSS_LAYOUT_H_
#define LORASTEP_LIB_MODEL_GPT_OSS_LAYOUT_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lorastep {

// The expert tensor a name ends in: kGateUp ("mlp.experts.gate_up_proj"), kGateUpBias, kDown,
// kDownBias, or kNone.
enum class GptOssExpertTensor { kNone, kGateUp, kGateUpBias, kDown, kDownBias };
GptOssExpertTensor GptOssExpertTensorOf(const std::string& name);

// The stored shape of an expert tensor whose lorastep shape is `shape`.
std::vector<int64_t> GptOssStoredShape(GptOssExpertTensor which, const std::vector<int64_t>& shape);
// Stored -> lorastep's layout, and back (contiguous copies).
at::Tensor GptOssFromStored(GptOssExpertTensor which, const at::Tensor& stored);
at::Tensor GptOssToStored(GptOssExpertTensor which, const at::Tensor& t);

// MXFP4 (OCP microscaling, 4-bit E2M1 values in groups of 32 sharing a power-of-two scale):
// blocks uint8 [..., G, 16] (two values a byte, the low nibble first), scales uint8 [..., G]
// (exponent + 127) -> [..., G * 32] in `dtype`. Exact: every value is representable in bf16.
at::Tensor DequantizeMxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_GPT_OSS_LAYOUT_H_
