// What one coordinator-to-worker hop costs without any training: a real gRPC callback
// Worker server on loopback whose TrainStep hands the call to a SerialExecutor (as the worker
// does) and answers at once, called through GrpcWorkerClient (the coordinator's client)
// with the benchmark's batch (64 x 512 tokens, 0.5B vocabulary) as repeated Datum messages
// and as packed_datums. Prints the median round trip over TCP loopback and over a Unix
// socket; --idle_ms sleeps between calls, as a training step leaves the service idle (cold
// threads and caches cost more than back-to-back calls).
//   bazel run //bench:hop_cost -- [--calls 200] [--idle_ms 0]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_batch.h"
#include "lib/flags_util.h"
#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/proto_convert.h"
#include "rpc/serial_executor.h"
#include "rpc/server_runner.h"
#include "server/grpc_worker_client.h"

ABSL_FLAG(int, calls, 200, "timed calls per transport (after 20 warm-up calls)");
ABSL_FLAG(int, idle_ms, 0, "sleep between calls, as a training step leaves the service idle");

namespace lorastep {
namespace {

// Answers TrainStep from its executor thread, as the real worker does, with nothing done.
class EchoWorker final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* TrainStep(grpc::CallbackServerContext* ctx, const v1::WorkerTrainStepRequest* req,
                                      v1::WorkerStepResponse* resp) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    executor_.Submit([reactor, req, resp] {
      resp->mutable_result()->set_learner_version(req->datums_size());
      reactor->Finish(grpc::Status::OK);
    });
    return reactor;
  }

 private:
  SerialExecutor executor_;
};

double MedianMs(GrpcWorkerClient& client, const v1::WorkerTrainStepRequest& req, int calls) {
  std::vector<double> ms;
  for (int i = 0; i < calls + 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_idle_ms)));
    auto t0 = std::chrono::steady_clock::now();
    auto r = client.TrainStep(req, BatchShard{});  // the datums travel in `req`
    const double d = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      std::exit(1);
    }
    if (i >= 20) ms.push_back(d);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace
}  // namespace lorastep

int main(int argc, char** argv) {
  using namespace lorastep;
  ParseCommandLineOrExit(argc, argv, "hop_cost [--calls 200]");
  TuneProcessForServing();
  v1::WorkerTrainStepRequest req;
  req.set_run_id("run-1");
  for (auto& d : RandomBatch(64, 512, 151936)) *req.add_datums() = d;
  std::printf("request bytes %zu\n", req.ByteSizeLong());
  EchoWorker service;
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string socket = "/tmp/lorastep_hop_cost_" + std::to_string(getpid());
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const int calls = absl::GetFlag(FLAGS_calls);
  GrpcWorkerClient tcp("127.0.0.1:" + std::to_string(port));
  GrpcWorkerClient unix_socket("unix:" + socket);
  // The same batch as packed_datums, as the coordinator sends it.
  v1::WorkerTrainStepRequest packed;
  packed.set_run_id("run-1");
  const std::vector<v1::Datum> datums(req.datums().begin(), req.datums().end());
  if (!PackDatums(datums, packed.mutable_packed_datums())) return 1;
  std::printf("packed request bytes %zu\n", packed.ByteSizeLong());
  // Alternated, so drift on the machine falls on all.
  for (int round = 0; round < 2; ++round) {
    std::printf("round %d: tcp datums %.3f ms, tcp packed %.3f ms, unix datums %.3f ms, unix packed %.3f ms\n", round,
                MedianMs(tcp, req, calls), MedianMs(tcp, packed, calls), MedianMs(unix_socket, req, calls),
                MedianMs(unix_socket, packed, calls));
  }
  server->Shutdown();
  unlink(socket.c_str());
  return 0;
}
