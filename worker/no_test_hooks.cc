// The production build: no fault injection (worker/test_hooks.h).
#include "worker/test_hooks.h"

namespace lorastep {

absl::Status ApplyTestFlags(WorkerOptions*) { return absl::OkStatus(); }

}  // namespace lorastep
