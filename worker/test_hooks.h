// The worker's test-only fault injection, applied from rpc/test_flags.h in the testing build
// (test_hooks.cc, lorastep_worker_testing); the production build links no_test_hooks.cc,
// which applies nothing (and has no such flags to parse).
#ifndef LORASTEP_WORKER_TEST_HOOKS_H_
#define LORASTEP_WORKER_TEST_HOOKS_H_

#include "absl/status/status.h"
#include "worker/worker_core.h"

namespace lorastep {

// Sets `options`' test-only fields from the test flags; INVALID_ARGUMENT naming a malformed one.
absl::Status ApplyTestFlags(WorkerOptions* options);

}  // namespace lorastep

#endif  // LORASTEP_WORKER_TEST_HOOKS_H_
