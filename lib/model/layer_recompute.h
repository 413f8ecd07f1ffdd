// How much of a decoder layer's activations training keeps (activation recomputation).
#ifndef LORASTEP_LIB_MODEL_LAYER_RECOMPUTE_H_
#define LORASTEP_LIB_MODEL_LAYER_RECOMPUTE_H_

namespace lorastep {

// What a decoder layer keeps for backward. kFull: only its input ([tokens, hidden]); the
// whole layer runs again in backward. kSelective: its input plus its attention output and
// softmax statistics; the replay skips attention's forward where the kernel exposes them
// (the packed layout's flash kernel, cuDNN's on padded rows) and its backward works from
// them; elsewhere attention's forward runs once more inside its backward, so selective
// costs full's time and more memory there.
enum class LayerRecompute { kNone, kSelective, kFull };

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_LAYER_RECOMPUTE_H_
