#include "lib/model/gpt_oss_layout.h"

#include "absl/strings/match.h"

namespace lorastep {

GptOssExpertTensor GptOssExpertTensorOf(const std::string& name) {
  if (absl::EndsWith(name, "mlp.experts.gate_up_proj")) return GptOssExpertTensor::kGateUp;
  if (absl::EndsWith(name, "mlp.experts.gate_up_proj_bias")) return GptOssExpertTensor::kGateUpBias;
  if (absl::EndsWith(name, "mlp.experts.down_proj")) return GptOssExpertTensor::kDown;
  if (absl::EndsWith(name, "mlp.experts.down_proj_bias")) return GptOssExpertTensor::kDownBias;
  return GptOssExpertTensor::kNone;
}

std::vector<int64_t> GptOssStoredShape(GptOssExpertTensor which, const std::vector<int64_t>& shape) {
  if (which == GptOssExpertTensor::kGateUp || which == GptOssExpertTensor::kDown) {
    return {shape[0], shape[2], shape[1]};
  }
  return shape;
}

at::Tensor GptOssFromStored(GptOssExpertTensor which, const at::Tensor& stored) {
  switch (which) {
    case GptOssExpertTensor::kGateUp: {  // [E, H, 2I] interleaved -> [E, 2I, H] gate rows, then up rows
      const int64_t e = stored.size(0), h = stored.size(1), f = stored.size(2) / 2;
      at::Tensor rows = stored.transpose(1, 2).reshape({e, f, 2, h});
      return at::cat({rows.select(2, 0), rows.select(2, 1)}, 1).contiguous();
    }
    case GptOssExpertTensor::kGateUpBias: {
      const int64_t e = stored.size(0), f = stored.size(1) / 2;
      at::Tensor pairs = stored.reshape({e, f, 2});
      return at::cat({pairs.select(2, 0), pairs.select(2, 1)}, 1).contiguous();
    }
    case GptOssExpertTensor::kDown:
      return stored.transpose(1, 2).contiguous();
    default:
      return stored.contiguous();
  }
}

at::Tensor GptOssToStored(GptOssExpertTensor which, const at::Tensor& t) {
  switch (which) {
    case GptOssExpertTensor::kGateUp: {  // [E, 2I, H] -> [E, H, 2I] interleaved
      const int64_t e = t.size(0), f = t.size(1) / 2, h = t.size(2);
      at::Tensor rows = at::stack({t.narrow(1, 0, f), t.narrow(1, f, f)}, 2).reshape({e, 2 * f, h});
      return rows.transpose(1, 2).contiguous();
    }
    case GptOssExpertTensor::kGateUpBias: {
      const int64_t e = t.size(0), f = t.size(1) / 2;
      return at::stack({t.narrow(1, 0, f), t.narrow(1, f, f)}, 2).reshape({e, 2 * f}).contiguous();
    }
    case GptOssExpertTensor::kDown:
      return t.transpose(1, 2).contiguous();
    default:
      return t.contiguous();
  }
}

at::Tensor DequantizeMxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  // E2M1: sign, two exponent bits, one mantissa bit.
  static const float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor lut = at::tensor(at::ArrayRef<float>(kValues, 16), at::kFloat).to(blocks.device());
  const at::Tensor b = blocks.to(at::kLong);
  at::Tensor low = lut.index_select(0, b.bitwise_and(15).reshape({-1})).view(b.sizes());
  at::Tensor high = lut.index_select(0, b.bitwise_right_shift(4).reshape({-1})).view(b.sizes());
  std::vector<int64_t> out_shape(blocks.sizes().begin(), blocks.sizes().end());
  out_shape.back() *= 2;
  at::Tensor values = at::stack({low, high}, -1).reshape(out_shape);  // [..., G, 32]
  at::Tensor scale = at::pow(2.0, scales.to(at::kFloat) - 127).unsqueeze(-1);
  out_shape.pop_back();
  out_shape.back() *= 2 * blocks.size(-1);
  return (values * scale).reshape(out_shape).to(dtype);
}

}  // namespace lorastep
