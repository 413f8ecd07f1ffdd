// Rotary position embedding tables as transformers computes them for each rope_type it
// knows (default, linear, dynamic, yarn, llama3; ModelConfig::rope).
#ifndef LORASTEP_LIB_MODEL_ROPE_H_
#define LORASTEP_LIB_MODEL_ROPE_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

#include "lib/model/model_config.h"

namespace lorastep {

// The inverse frequencies [rotary_dim / 2] (head_dim / 2 but for partial rotary) (float32, in transformers' order of operations, so
// fp32 log-probs match its to ~1e-6) and the scale on cos and sin (yarn's attention factor;
// 1 otherwise), for sequences of `length` positions: only dynamic RoPE depends on it (past
// its original length the base grows with the length, as transformers' first call computes).
std::pair<at::Tensor, double> RopeFrequencies(const ModelConfig& c, int64_t length);

// cos/sin tables [s, rotary_dim] (fp32, scaled, then cast to `options`' dtype), kept per RoPE
// setting, device and dtype and grown to the longest length asked for: a row depends on its
// position only, so a prefix of a longer table is bitwise the short one (dynamic RoPE past
// its original length: a table per length). Built once, not per micro-batch: the build ends
// in a host-to-device copy, which waits for the device queue, so per micro-batch it drained
// the previous backward before each forward could launch anything (the LoRA forward is
// launch-bound on a GPU). Never freed: device tensors must not outlive their runtime.
std::pair<at::Tensor, at::Tensor> RopeTables(const ModelConfig& c, int64_t s, const at::TensorOptions& options);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_ROPE_H_
