// Flags both servers read (the coordinator and the worker, on absl flags): the Prometheus
// endpoint and the log verbosity. Each binary defines its own other flags in its main file;
// the test-only fault injection flags exist only in the test builds (rpc/test_flags.h).
#ifndef LORASTEP_RPC_SERVER_FLAGS_H_
#define LORASTEP_RPC_SERVER_FLAGS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"
#include "rpc/metrics_http_server.h"

ABSL_DECLARE_FLAG(std::optional<int>, metrics_port);
ABSL_DECLARE_FLAG(std::string, metrics_host);
ABSL_DECLARE_FLAG(bool, metrics_allow_remote);
ABSL_DECLARE_FLAG(std::string, metrics_port_file);

namespace lorastep {

// --v: per-call log lines (CallObservers::log_verbosity). Read through this function: the
// flag's C++ name FLAGS_v would clash with glog's, which Debian's LibTorch headers declare.
int VerbosityFlag();

// The Prometheus endpoint the --metrics_* flags ask for (none without --metrics_port).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpointFromFlags(const PrometheusRegistry* registry);

// "--name=value" for each flag of `names` whose value is not its default, to pass it on to
// a child that has the same flags with the same defaults.
std::vector<std::string> NonDefaultFlagArgs(const std::vector<std::string>& names);

// The worker's test-only flags: every registered flag named test_* (rpc/test_flags.cc,
// linked only into the testing binaries), as NonDefaultFlagArgs takes them: a testing
// coordinator passes them on to its local workers; a production build registers none, and
// its binaries refuse them as unknown.
const std::vector<std::string>& WorkerTestFlagNames();

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERVER_FLAGS_H_
