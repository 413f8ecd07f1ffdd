// lorastep_worker: one per GPU (or one CPU process). Loads the base model once and serves
// the internal Worker API.
//   lorastep_worker --model DIR [--device cuda:0] [--dtype bfloat16] [--host 127.0.0.1]
//                   [--port 0] [--port_file F] [--max_tokens_per_microbatch N] [--unfused_wgrad]
#include <iostream>

#include "server/server_runner.h"
#include "worker/worker_core.h"
#include "worker/worker_service.h"

int main(int argc, char** argv) {
  using namespace lorastep;
  BlockShutdownSignals();
  auto flags = ParseFlags(argc, argv);
  WorkerOptions options;
  options.model_path = flags["model"];
  if (options.model_path.empty()) {
    std::cerr << "lorastep_worker: --model is required\n";
    return 2;
  }
  if (flags.count("device")) options.device = flags["device"];
  if (flags.count("dtype")) options.dtype = flags["dtype"];
  if (flags.count("max_tokens_per_microbatch")) {
    options.max_tokens_per_microbatch = std::stoll(flags["max_tokens_per_microbatch"]);
  }
  options.grad.fused_wgrad = !flags.count("unfused_wgrad");
  auto core = WorkerCore::Create(options);
  if (!core.ok()) {
    std::cerr << "lorastep_worker: " << core.status() << "\n";
    return 1;
  }
  WorkerService service(core->get());
  int port = 0;
  auto server = StartGrpcServer(flags.count("host") ? flags["host"] : "127.0.0.1",
                                flags.count("port") ? std::stoi(flags["port"]) : 0, {&service},
                                &port);
  if (!server.ok()) {
    std::cerr << "lorastep_worker: " << server.status() << "\n";
    return 1;
  }
  if (flags.count("port_file")) {
    if (auto s = WritePortFile(flags["port_file"], port); !s.ok()) {
      std::cerr << "lorastep_worker: " << s << "\n";
      return 1;
    }
  }
  std::cerr << "lorastep_worker: serving " << options.model_path << " on port " << port << " ("
            << (*core)->base().device.str() << ")\n";
  WaitForShutdownSignal();
  (*server)->Shutdown();
  return 0;
}
