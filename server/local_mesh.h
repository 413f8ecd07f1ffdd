// Checks of a mesh of local workers made before any of them starts: each size in range, the
// world within the machine (one GPU per rank with --device cuda, --max_local_workers CPU
// processes otherwise), and the sizes against the model's config.json (heads, widths,
// layers and experts divided as the ranks will split them). LibTorch-free.
#ifndef LORASTEP_SERVER_LOCAL_MESH_H_
#define LORASTEP_SERVER_LOCAL_MESH_H_

#include <string>

#include "absl/status/status.h"
#include "lib/parallel/parallel_layout.h"

namespace lorastep {

// GPUs this process may use: the entries of $CUDA_VISIBLE_DEVICES when it is set, else the
// /dev/nvidia<N> device files (no CUDA library needed).
int VisibleCudaDevices();

// INVALID_ARGUMENT naming the flag when a size is outside [1, 4096] or the world
// (tp*pp*dp*cp) above 4096 ranks: checked before anything multiplies them.
absl::Status CheckMeshSizes(const ParallelSizes& sizes);

// INVALID_ARGUMENT naming the flag: CheckMeshSizes, a world (tp*pp*dp*cp) above
// `device_slots` (the visible GPUs on CUDA, the CPU cap otherwise; `slots_flag` names what
// bounds it), or sizes the model at `model_dir` cannot be split by.
absl::Status CheckLocalMesh(const ParallelSizes& sizes, const std::string& model_dir, int device_slots,
                            const std::string& slots_what);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_LOCAL_MESH_H_
