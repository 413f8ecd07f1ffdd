#include "rpc/server_flags.h"

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rpc/server_runner.h"

ABSL_FLAG(std::optional<int>, metrics_port, std::nullopt,
          "serve Prometheus text format at GET /metrics on this port (0: any free port); off when unset");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "address of the metrics endpoint");
ABSL_FLAG(bool, metrics_allow_remote, false, "allow a non-loopback --metrics_host (the endpoint has no auth)");
ABSL_FLAG(std::string, metrics_port_file, "", "write the metrics endpoint's port here once bound");
ABSL_FLAG(int, v, 1, "per-call log lines on stderr: 0 failures only, 1 every call, 2 with health checks, -1 none");

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
  // The testing binaries register the --test_* flags (rpc/test_flags.cc); production ones
  // register none, so they pass nothing on.
  static const auto* names = [] {
    auto* found = new std::vector<std::string>;
    for (const auto& [name, flag] : absl::GetAllFlags()) {
      if (absl::StartsWith(name, "test_")) found->emplace_back(name);
    }
    std::sort(found->begin(), found->end());
    return found;
  }();
  return *names;
}

}  // namespace lorastep
