// The attention paths of the decoder's layers (lib/model/qwen2.cc): causal attention over
// padded rows, packed sequences and context ranks, with sliding windows and attention sinks,
// and what a selectively recomputed layer keeps of its attention.
#ifndef LORASTEP_LIB_MODEL_ATTENTION_PATHS_H_
#define LORASTEP_LIB_MODEL_ATTENTION_PATHS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

#include "lib/model/qwen2.h"
#include "lib/model/sink_attention.h"
#include "lib/torch_compat.h"

namespace lorastep {

using AttentionFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

// A selectively recomputed layer's attention (LayerRecompute::kSelective): the no-grad forward
// fills it, the replay reads it. With a fused kernel that exposes its softmax statistics (the
// packed layout's flash kernel, or cuDNN's on padded rows) it holds them, and backward runs
// the kernel's own backward; otherwise it holds the output, and backward runs `attend` once
// more with autograd. Owned by the layer's RecomputedLayerNode, which outlives every use.
struct KeptAttention {
  enum class Kernel { kReplay, kFlash, kCudnn, kSinkFlash };
  Kernel kernel = Kernel::kReplay;
  at::Tensor out;                            // the attention output the replay returns
  compat::VarlenAttentionSaved flash;        // kFlash: out [total, heads, d], log-sum-exp, rng state
  SinkAttentionSaved sink;                   // kSinkFlash: frozen sinks through the flash kernel's log-sum-exp
  at::Tensor cu_seqlens;                     // kFlash
  int64_t max_length = 0;                    // kFlash
  compat::CudnnAttentionSaved cudnn;         // kCudnn: out [b, heads, s, d], log-sum-exp, ...
  AttentionFn attend;                        // kReplay: the replay's attention (set by the replay)
};

// The kept output for (q, k, v) without running attention, back-propagating as attention does
// (through the kept kernel's statistics, or `kept->attend` once more). q/k/v are laid out as
// the kept kernel took them; `kept` outlives the backward.
at::Tensor KeptAttentionOutput(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, KeptAttention* kept);

// Causal attention of packed sequences: q [1, total, heads, d], k/v [1, total, kv, d] ->
// [1, total, heads * d]. Sequences all of one length run as padded rows without padding
// where SDPA picks cuDNN's kernel for them (faster than the flash kernels at head dim 128:
// docs/PERFORMANCE.md); else one varlen kernel where available (a sliding layer's `window` >
// 0 too, its masked blocks skipped), else each sequence alone. Attention sinks: the varlen
// kernel through its log-sum-exp where UseSinkFlash says so (lib/model/sink_attention.h),
// else each sequence alone through its mask, as a window without the varlen kernel.
at::Tensor PackedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const PackedSequences& packed, int64_t window, const at::Tensor& sinks);

// q [b, heads, s, d] over k/v [b, kv, s, d]: causal, in a sliding window (window > 0), and
// with attention sinks [heads] where defined.
at::Tensor CausalOrMasked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                          const at::Tensor& sinks);

// Causal attention of this context rank's tokens over every rank's (packed.context_group):
// q [1, t, heads, d], k/v [1, t, kv, d] -> [1, t, heads * d].
at::Tensor ContextAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const PackedSequences& packed, int64_t window, const at::Tensor& sinks);

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_ATTENTION_PATHS_H_
