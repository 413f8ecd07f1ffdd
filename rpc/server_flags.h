// Flags both servers read (the coordinator and the worker, on absl flags): the Prometheus
// endpoint, the log verbosity, and the worker's test-only fault injection, which the
// coordinator accepts too and passes on to its local workers. Each binary defines its own
// other flags in its main file.
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
ABSL_DECLARE_FLAG(std::string, test_grad_fault);
ABSL_DECLARE_FLAG(std::string, test_skip_shared_reduction);
ABSL_DECLARE_FLAG(std::optional<int>, test_shared_reductions);
ABSL_DECLARE_FLAG(int, test_check_grad_digests);
ABSL_DECLARE_FLAG(int, test_autosave_write_delay_ms);
ABSL_DECLARE_FLAG(int, test_corrupt_main_grad_rank);
ABSL_DECLARE_FLAG(int, test_inventory_mismatch_rank);
ABSL_DECLARE_FLAG(std::string, test_refuse);

namespace lorastep {

// --v: per-call log lines (CallObservers::log_verbosity). Read through this function: the
// flag's C++ name FLAGS_v would clash with glog's, which Debian's LibTorch headers declare.
int VerbosityFlag();

// The Prometheus endpoint the --metrics_* flags ask for (none without --metrics_port).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpointFromFlags(const PrometheusRegistry* registry);

// "--name=value" for each flag of `names` whose value is not its default, to pass it on to
// a child that has the same flags with the same defaults.
std::vector<std::string> NonDefaultFlagArgs(const std::vector<std::string>& names);

// The worker's test-only flags, as NonDefaultFlagArgs takes them.
const std::vector<std::string>& WorkerTestFlagNames();

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERVER_FLAGS_H_
