// lorastep_coordinator: the public Trainer API. By default it starts one local worker
// process on the given model; with --workers it uses running workers instead; with
// --wait_for_workers it starts with none and waits for workers to register
// (lorastep_worker --register_with this address).
//   lorastep_coordinator --model DIR [--device cpu] [--dtype D] [--port 50051] [--host 127.0.0.1]
//                        [--port_file F] [--workers host:port,host:port] [--wait_for_workers]
//                        [--worker_binary PATH] [--max_tokens_per_microbatch N]
//                        [--worker_start_timeout_s 300]
#include <iostream>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_split.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/grpc_worker_client.h"
#include "server/registry_service.h"
#include "server/child_server.h"
#include "server/server_runner.h"

int main(int argc, char** argv) {
  using namespace lorastep;
  BlockShutdownSignals();
  auto flags = ParseFlags(argc, argv);
  auto fail = [](const absl::Status& s) {
    std::cerr << "lorastep_coordinator: " << s << "\n";
    return 1;
  };
  std::vector<std::string> addresses;
  std::optional<ChildServer> local;
  if (flags.count("workers")) {
    addresses = absl::StrSplit(flags["workers"], ',', absl::SkipEmpty());
  } else if (!flags.count("wait_for_workers")) {
    if (flags["model"].empty()) {
      std::cerr << "lorastep_coordinator: --model (for the local worker) or --workers is required\n";
      return 2;
    }
    std::vector<std::string> args = {"--model", flags["model"]};
    for (const char* pass : {"device", "dtype", "max_tokens_per_microbatch"}) {
      if (flags.count(pass)) args.insert(args.end(), {std::string("--") + pass, flags[pass]});
    }
    if (flags.count("unfused_wgrad")) args.push_back("--unfused_wgrad");
    const std::string binary =
        flags.count("worker_binary") ? flags["worker_binary"] : FindWorkerBinary(argv[0]);
    const int timeout = flags.count("worker_start_timeout_s") ? std::stoi(flags["worker_start_timeout_s"]) : 300;
    auto started = ChildServer::Start(binary, args, timeout);
    if (!started.ok()) return fail(started.status());
    local.emplace(std::move(started).value());
    addresses.push_back(local->address());
  }
  Coordinator core{CoordinatorOptions()};
  for (const auto& a : addresses) {
    auto client = std::make_unique<GrpcWorkerClient>(a);
    if (auto s = client->WaitReady(60); !s.ok()) return fail(s);
    if (auto s = core.AddWorker(std::move(client)); !s.ok()) return fail(s);
  }
  CoordinatorService service(&core);
  RegistryService registry(&core);
  int port = 0;
  auto server = StartGrpcServer(flags.count("host") ? flags["host"] : "127.0.0.1",
                                flags.count("port") ? std::stoi(flags["port"]) : 50051,
                                {&service, &registry}, &port);
  if (!server.ok()) return fail(server.status());
  if (flags.count("port_file")) {
    if (auto s = WritePortFile(flags["port_file"], port); !s.ok()) return fail(s);
  }
  if (addresses.empty()) {
    std::cerr << "lorastep_coordinator: port " << port << ", waiting for workers to register\n";
  } else {
    std::cerr << "lorastep_coordinator: serving " << core.model_path() << " on port " << port
              << " with " << addresses.size() << " worker(s)\n";
  }
  WaitForShutdownSignal();
  std::cerr << "lorastep_coordinator: shutting down\n";
  (*server)->Shutdown();
  if (local) local->Stop();
  return 0;
}
