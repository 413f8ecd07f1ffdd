// Gathering the tensors of every pipeline stage onto the first stage (checkpoints, exports,
// the adapter digest), over the pipeline process group itself.
#ifndef LORASTEP_LIB_TRAINING_STAGE_GATHER_H_
#define LORASTEP_LIB_TRAINING_STAGE_GATHER_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "lib/parallel/process_groups.h"

namespace lorastep {

using NamedTensor = std::pair<std::string, at::Tensor>;

// Stages hold different tensors, so no shape-agreeing collective fits: each later stage
// sends stage 0 one byte tensor (a JSON header naming each tensor's dtype, shape and byte
// range, then the bytes), preceded by its two sizes. Nothing a sender does before its sends
// can fail on its own (no file, no parse), so stage 0 never waits on a stage that gave up.
// Stage 0 returns its own tensors, then each later stage's in stage order, on `device`; the
// other stages return `local`.
absl::StatusOr<std::vector<NamedTensor>> GatherStagesToFirst(CommGroup& pipe, std::vector<NamedTensor> local,
                                                             const at::Device& device);

// The wire form above, exposed for its tests: packs `tensors` (any device) into bytes on
// the CPU; unpacks them (CPU tensors) or says what is malformed.
struct PackedTensors {
  std::string header;  // JSON
  std::string bytes;
};
PackedTensors PackTensors(const std::vector<NamedTensor>& tensors);
absl::StatusOr<std::vector<NamedTensor>> UnpackTensors(const std::string& header, const char* bytes, size_t size);

}  // namespace lorastep

#endif  // LORASTEP_LIB_TRAINING_STAGE_GATHER_H_
