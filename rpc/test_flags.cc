#include "rpc/test_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, test_grad_fault, "",
          "test only: BUCKET:skip, BUCKET:double, BUCKET:corrupt:RANK or BUCKET:plan:RANK, a fault in one "
          "gradient bucket's reduction (plan: that rank's reduction plan of the bucket differs)");
ABSL_FLAG(std::string, test_skip_shared_reduction, "",
          "test only: skip the shared-outer reduction of this family (fc1 or fc2)");
ABSL_FLAG(std::optional<int>, test_shared_reductions, std::nullopt,
          "test only: reductions of the shared-outer factors per step");
ABSL_FLAG(int, test_check_grad_digests, 1, "test only: 0 runs without the gradient-digest checks");
ABSL_FLAG(int, test_autosave_write_delay_ms, 0, "test only: background SaveStates wait this long before writing");
ABSL_FLAG(int, test_corrupt_main_grad_rank, -1, "test only: corrupt this rank's main_grad after reduction");
ABSL_FLAG(int, test_inventory_mismatch_rank, -1, "test only: alter this rank's factor inventory");
ABSL_FLAG(std::string, test_refuse, "",
          "test only: CALL:RANK, rank RANK refuses its first CALL (ForwardBackward, Forward, OptimStep, TrainStep) at "
          "admission; AdamW:RANK, each run's first staged optimizer update fails there");
