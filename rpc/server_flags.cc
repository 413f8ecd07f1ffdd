#include "rpc/server_flags.h"

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "rpc/server_runner.h"

ABSL_FLAG(std::optional<int>, metrics_port, std::nullopt,
          "serve Prometheus text format at GET /metrics on this port (0: any free port); off when unset");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "address of the metrics endpoint");
ABSL_FLAG(bool, metrics_allow_remote, false, "allow a non-loopback --metrics_host (the endpoint has no auth)");
ABSL_FLAG(std::string, metrics_port_file, "", "write the metrics endpoint's port here once bound");
ABSL_FLAG(int, v, 1, "per-call log lines on stderr: 0 failures only, 1 every call, 2 with health checks, -1 none");
ABSL_FLAG(std::string, test_grad_fault, "",
          "test only: BUCKET:skip, BUCKET:double or BUCKET:corrupt:RANK, a fault in one gradient bucket's reduction");
ABSL_FLAG(std::string, test_skip_shared_reduction, "",
          "test only: skip the shared-outer reduction of this family (fc1 or fc2)");
ABSL_FLAG(std::optional<int>, test_shared_reductions, std::nullopt,
          "test only: reductions of the shared-outer factors per step");
ABSL_FLAG(int, test_check_grad_digests, 1, "test only: 0 runs without the gradient-digest checks");
ABSL_FLAG(int, test_autosave_write_delay_ms, 0, "test only: background SaveStates wait this long before writing");
ABSL_FLAG(int, test_corrupt_main_grad_rank, -1, "test only: corrupt this rank's main_grad after reduction");
ABSL_FLAG(int, test_inventory_mismatch_rank, -1, "test only: alter this rank's factor inventory");
ABSL_FLAG(std::string, test_refuse, "",
          "test only: CALL:RANK, rank RANK refuses its first CALL (ForwardBackward, Forward, OptimStep, TrainStep) at admission");

namespace lorastep {


int VerbosityFlag() { return absl::GetFlag(FLAGS_v); }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsEndpointFromFlags(const PrometheusRegistry* registry) {
  const std::optional<int> port = absl::GetFlag(FLAGS_metrics_port);
  if (!port) return std::unique_ptr<MetricsHttpServer>();
  auto server = MetricsHttpServer::Start(absl::GetFlag(FLAGS_metrics_host), *port, registry,
                                         absl::GetFlag(FLAGS_metrics_allow_remote));
  if (!server.ok()) return server.status();
  if (const std::string file = absl::GetFlag(FLAGS_metrics_port_file); !file.empty()) {
    if (absl::Status s = WritePortFile(file, (*server)->port()); !s.ok()) return s;
  }
  return server;
}

std::vector<std::string> NonDefaultFlagArgs(const std::vector<std::string>& names) {
  std::vector<std::string> args;
  for (const std::string& name : names) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && flag->CurrentValue() != flag->DefaultValue()) {
      args.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  return args;
}

const std::vector<std::string>& WorkerTestFlagNames() {
  static const auto* names = new std::vector<std::string>{
      "test_grad_fault",            "test_skip_shared_reduction", "test_shared_reductions",
      "test_check_grad_digests",    "test_corrupt_main_grad_rank", "test_inventory_mismatch_rank",
      "test_autosave_write_delay_ms", "test_refuse"};
  return *names;
}

}  // namespace lorastep
