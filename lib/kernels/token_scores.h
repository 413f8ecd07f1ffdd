// Row statistics of LM-head logits in one pass over each row (CUDA build only): what the
// frozen-head log-probs need, without the fp32 [rows, vocab] temporaries that ATen's
// log_softmax / exp / dot sequence writes and reads back (on a 151,936-token vocabulary,
// 0.6 GB for every 1,024 rows).
#ifndef LORASTEP_LIB_KERNELS_TOKEN_SCORES_H_
#define LORASTEP_LIB_KERNELS_TOKEN_SCORES_H_

#include <cstdint>

#include "lib/kernels/element_type.h"

namespace lorastep {
namespace kernels {

// logits: rows x vocab, row stride `row_stride` elements, of `type`. For each row r:
//   logprobs[r] = z[targets[r]] - lse,  entropy[r] = lse - E_p[z]   (fp32)
// and, when non-null, lse_out[r] = lse, probs[r, v] = p_v and probs_logprobs[r, v] =
// p_v * log p_v, written contiguously (rows x vocab) in `type` (the inputs of the gradient
// GEMMs). Runs on `stream` (a cudaStream_t). Returns a CUDA error string, or nullptr.
const char* LaunchTokenScores(const void* logits, ElementType type, int64_t rows, int64_t vocab,
                              int64_t row_stride, const int64_t* targets, float* logprobs,
                              float* entropy, float* lse_out, void* probs, void* probs_logprobs,
                              void* stream);

// The gradient of the logits for a trainable head, in one pass over each row:
//   grad[r, v] = g_lp[r] * (v == t_r) - p_v * (g_lp[r] + g_ent[r] * (log p_v + entropy[r]))
// from the recomputed logits and the forward's lse and entropy; g_lp / g_ent may be null
// (zero). Written contiguously (rows x vocab) in `type`.
const char* LaunchTokenScoresGrad(const void* logits, ElementType type, int64_t rows, int64_t vocab,
                                  int64_t row_stride, const int64_t* targets, const float* lse,
                                  const float* entropy, const float* g_lp, const float* g_ent,
                                  void* grad, void* stream);

}  // namespace kernels
}  // namespace lorastep

#endif  // LORASTEP_LIB_KERNELS_TOKEN_SCORES_H_
