#include "rpc/server_process.h"

#include <utility>

#include "lib/flags_util.h"
#include "lib/log.h"
#include "lib/parent_death.h"
#include "rpc/server_flags.h"

namespace lorastep {

ServerProcess::ServerProcess(int argc, char** argv, std::string name, const char* usage)
    : name_(std::move(name)), endpoint_(absl::UnknownError("not started")) {
  ExitWithSpawningParent();  // a local worker (or a test's server) goes with its parent
  TuneProcessForServing();
  BlockShutdownSignals();
  ParseCommandLineOrExit(argc, argv, usage);
  InitLogging(argv[0]);
  startup_ = std::make_unique<StartupSignalWatcher>(name_);
  // Off unless --metrics_port; refused on a non-loopback host without --metrics_allow_remote.
  endpoint_ = StartMetricsEndpointFromFlags(&metrics_);
}

int ServerProcess::Fail(const absl::Status& status, int exit_code) const {
  LORASTEP_LOG(Error) << name_ << ": " << status;
  return exit_code;
}

void ServerProcess::ServeUntilShutdownSignal(std::chrono::seconds exit_deadline) {
  startup_->Serving();
  const std::string signal = WaitForShutdownSignal();
  LORASTEP_LOG(Info) << name_ << ": shutting down (" << signal << ")";
  ExitAfter(exit_deadline, name_);
}

}  // namespace lorastep
