// Test-only fault injection flags, linked only into the testing builds of the servers
// (lorastep_worker_testing, lorastep_coordinator_testing): the production binaries do not
// define them, so they refuse them as unknown. The coordinator passes the non-default ones
// on to its local workers (WorkerTestFlagNames), which apply them (worker/test_hooks.h).
#ifndef LORASTEP_RPC_TEST_FLAGS_H_
#define LORASTEP_RPC_TEST_FLAGS_H_

#include <optional>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, test_grad_fault);
ABSL_DECLARE_FLAG(std::string, test_skip_shared_reduction);
ABSL_DECLARE_FLAG(std::optional<int>, test_shared_reductions);
ABSL_DECLARE_FLAG(int, test_check_grad_digests);
ABSL_DECLARE_FLAG(int, test_autosave_write_delay_ms);
ABSL_DECLARE_FLAG(int, test_corrupt_main_grad_rank);
ABSL_DECLARE_FLAG(int, test_inventory_mismatch_rank);
ABSL_DECLARE_FLAG(std::string, test_refuse);

#endif  // LORASTEP_RPC_TEST_FLAGS_H_
