// The start and end of both servers' main (lorastep_coordinator, lorastep_worker), in one
// place: what every serving process does before it reads its own flags, and how it waits for
// its shutdown signal.
#ifndef LORASTEP_RPC_SERVER_PROCESS_H_
#define LORASTEP_RPC_SERVER_PROCESS_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lib/prometheus_registry.h"
#include "rpc/metrics_http_server.h"
#include "rpc/server_runner.h"

namespace lorastep {

class ServerProcess {
 public:
  // In order: the process goes with the parent that spawned it, per-call costs are tuned,
  // SIGINT/SIGTERM are blocked (until Serving(), one ends the process at once: start-up
  // leaves nothing running), the command line is parsed (bad flags exit with a message),
  // logging starts, and the Prometheus endpoint of the --metrics_* flags starts (its
  // failure is in metrics_status()).
  ServerProcess(int argc, char** argv, std::string name, const char* usage);
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // Logs "<name>: <status>" and returns `exit_code`, for main's return.
  int Fail(const absl::Status& status, int exit_code = 2) const;
  const std::string& name() const { return name_; }
  PrometheusRegistry* metrics() { return &metrics_; }
  absl::Status metrics_status() const { return endpoint_.status(); }

  // Start-up is over: waits for SIGINT or SIGTERM, logs it, and arms the exit after
  // `exit_deadline` (a call stuck in a device kernel or a collective does not hold it).
  void ServeUntilShutdownSignal(std::chrono::seconds exit_deadline);

 private:
  const std::string name_;
  std::unique_ptr<StartupSignalWatcher> startup_;
  PrometheusRegistry metrics_;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> endpoint_;
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_SERVER_PROCESS_H_
