// What one coordinator-to-worker hop costs without any training: a real gRPC callback
// Worker server on loopback whose TrainStep hands the call to a SerialExecutor (as the worker
// does) and answers at once, called through GrpcWorkerClient (the coordinator's client)
// with the benchmark's batch (64 x 512 tokens, 0.5B vocabulary) as repeated Datum messages
// and as packed_datums. Prints the median round trip over TCP loopback and over a Unix
// socket; --idle_ms sleeps between calls, as a training step leaves the service idle (cold
// threads and caches cost more than back-to-back calls). --timeline splits the packed TCP
// round trip (client and server share one clock here): delivering the request up to the
// handler, the hand-off to the executor, and the answer from Finish back to the caller.
// --step_ms keeps the executor busy per call instead (the client calls again at once), and
// --executor_spin_us lets it poll for the next call afterwards.
//   bazel run //bench:hop_cost -- [--calls 200] [--idle_ms 0] [--step_ms 0] [--executor_spin_us 0] [--timeline]
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
ABSL_FLAG(int, step_ms, 0,
          "busy the executor this long per call before it answers, as a training step does (the "
          "client then calls again at once; the gRPC threads idle meanwhile)");
ABSL_FLAG(int, executor_spin_us, 0, "the executor polls this long for the next call after each (SerialExecutor)");
ABSL_FLAG(bool, timeline, false, "split the packed TCP round trip into request, hand-off and answer");
ABSL_FLAG(std::vector<std::string>, server_args, {},
          "integer gRPC channel arguments for the server, name=value,... (e.g. grpc.experimental.tcp_read_chunk_size=1048576)");

namespace lorastep {
namespace {

using Clock = std::chrono::steady_clock;

// When the last call reached the handler, started on the executor, and called Finish.
struct ServerTimes {
  std::atomic<int64_t> handler_ns{0}, task_ns{0}, finish_ns{0}, finished_ns{0};
};

int64_t NowNs() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// Answers TrainStep from its executor thread, as the real worker does, with nothing done.
class EchoWorker final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* TrainStep(grpc::CallbackServerContext* ctx, const v1::WorkerTrainStepRequest* req,
                                      v1::WorkerStepResponse* resp) override {
    times_.handler_ns = NowNs();
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    executor_.Submit([this, reactor, req, resp] {
      times_.task_ns = NowNs();
      const int64_t busy_until = times_.task_ns + int64_t{absl::GetFlag(FLAGS_step_ms)} * 1000000;
      while (NowNs() < busy_until) {
      }
      resp->mutable_result()->set_learner_version(req->datums_size());
      times_.finish_ns = NowNs();
      reactor->Finish(grpc::Status::OK);
      times_.finished_ns = NowNs();
    });
    return reactor;
  }
  const ServerTimes& times() const { return times_; }

 private:
  ServerTimes times_;
  SerialExecutor executor_{std::chrono::microseconds(absl::GetFlag(FLAGS_executor_spin_us))};
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The packed round trip in three parts, medians over `calls` after 20 warm-up calls.
void PrintTimeline(GrpcWorkerClient& client, const EchoWorker& server, const v1::WorkerTrainStepRequest& req,
                   int calls) {
  std::vector<double> deliver, handoff, answer, finish, total;
  for (int i = 0; i < calls + 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_idle_ms)));
    const int64_t t0 = NowNs();
    auto r = client.TrainStep(req, BatchShard{});
    const int64_t t1 = NowNs();
    if (!r.ok()) std::exit(1);
    if (i < 20) continue;
    const ServerTimes& s = server.times();
    deliver.push_back((s.handler_ns - t0) / 1e6);
    handoff.push_back((s.task_ns - s.handler_ns) / 1e6);
    answer.push_back((t1 - s.finish_ns) / 1e6);
    finish.push_back((s.finished_ns - s.finish_ns) / 1e6);
    total.push_back((t1 - t0) / 1e6 - absl::GetFlag(FLAGS_step_ms));
  }
  std::printf("timeline (tcp packed, idle %d ms, step %d ms, executor spin %d us, %zu server args): request to "
              "handler %.3f ms, hand-off %.3f ms, Finish to caller %.3f ms (Finish itself %.3f ms), round trip less the step %.3f ms\n",
              absl::GetFlag(FLAGS_idle_ms), absl::GetFlag(FLAGS_step_ms), absl::GetFlag(FLAGS_executor_spin_us),
              absl::GetFlag(FLAGS_server_args).size(), Median(deliver), Median(handoff), Median(answer), Median(finish), Median(total));
}

double MedianMs(GrpcWorkerClient& client, const v1::WorkerTrainStepRequest& req, int calls) {
  std::vector<double> ms;
  for (int i = 0; i < calls + 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_idle_ms)));
    auto t0 = Clock::now();
    auto r = client.TrainStep(req, BatchShard{});  // the datums travel in `req`
    const double d = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
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
  for (const std::string& arg : absl::GetFlag(FLAGS_server_args)) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "server_args: '%s' is not name=value\n", arg.c_str());
      return 2;
    }
    builder.AddChannelArgument(arg.substr(0, eq), std::stoi(arg.substr(eq + 1)));
  }
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
  if (absl::GetFlag(FLAGS_timeline)) {
    PrintTimeline(tcp, service, packed, calls);
    server->Shutdown();
    unlink(socket.c_str());
    return 0;
  }
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
