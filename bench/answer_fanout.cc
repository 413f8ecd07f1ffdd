// How long N answers released at once take to reach N clients, without any training: a
// real gRPC Trainer server on loopback (its own process) holds every run's TrainStep until
// all N have arrived, waits --hold_ms (a step), then answers them all (a StepResponse with
// --metrics entries, as a co-scheduled step answers its runs); the clients are TrainerClients,
// one per run, each sending its next call as soon as it has its answer. Per round: each
// answer's delay from the server's release to its client's receipt (one steady clock across
// the processes). --busy_threads keeps that many server threads polling for --busy_ms after
// each release, as executor threads that poll for their runs' next calls do. Client layouts, each in turn against a fresh server: every run a thread of
// one process (each TrainerClient waiting on its own completion queue), or every run its own
// process, as separate tenants' loops are.
//   bazel run //bench:answer_fanout -- [--runs 32] [--rounds 40] [--hold_ms 50] [--metrics 40]
//     [--busy_threads 0 --busy_ms 5] [--layouts threads,processes] [--out F.json]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_flags.h"
#include "bench/bench_stats.h"
#include "clients/cpp/trainer_client.h"
#include "lib/flags_util.h"
#include "lorastep/v1/trainer.grpc.pb.h"
#include "nlohmann/json.hpp"

#include <grpcpp/grpcpp.h>

ABSL_FLAG(int, runs, 32, "runs (clients) answered at once");
ABSL_FLAG(int, rounds, 40, "rounds timed (after 5 warm-up rounds)");
ABSL_FLAG(int, hold_ms, 50, "the server holds each round's calls this long after the last arrives (a step)");
ABSL_FLAG(int, metrics, 40, "metrics entries in each answer");
ABSL_FLAG(int, busy_threads, 0,
          "after each release the server process also keeps this many threads polling (spinning) for --busy_ms, "
          "as executors that poll for their runs' next calls do");
ABSL_FLAG(int, busy_ms, 5, "how long each --busy_threads thread polls after a release");
ABSL_FLAG(std::vector<std::string>, layouts, std::vector<std::string>({"threads", "processes"}),
          "client layouts to measure, in turn");

namespace lorastep {
namespace {

constexpr int kWarmup = 5;

bool WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string ReadAll(int fd) {
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  return text;
}

// Holds TrainStep calls until `runs` are waiting, then after `hold` answers them all and
// reports the release time of each round on `report_fd` ("release <round> <ns>").
class HoldingTrainer final : public v1::Trainer::CallbackService {
 public:
  HoldingTrainer(int runs, std::chrono::milliseconds hold, int metrics, int report_fd)
      : runs_(runs), hold_(hold), metrics_(metrics), report_fd_(report_fd) {
    releaser_ = std::thread([this] { Release(); });
  }
  ~HoldingTrainer() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    releaser_.join();
  }
  grpc::ServerUnaryReactor* TrainStep(grpc::CallbackServerContext* ctx, const v1::TrainStepRequest* req,
                                      v1::StepResponse* resp) override {
    (void)req;
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_.push_back({reactor, resp});
    }
    cv_.notify_all();
    return reactor;
  }

 private:
  struct Waiting {
    grpc::ServerUnaryReactor* reactor;
    v1::StepResponse* resp;
  };
  void Release() {
    for (int round = 0;; ++round) {
      std::vector<Waiting> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || static_cast<int>(waiting_.size()) >= runs_; });
        if (stopping_) return;
        batch.swap(waiting_);
      }
      std::this_thread::sleep_for(hold_);
      const int64_t released = SteadyNs();
      std::vector<std::thread> busy;
      for (int t = 0; t < absl::GetFlag(FLAGS_busy_threads); ++t) {
        busy.emplace_back([until = released + int64_t{absl::GetFlag(FLAGS_busy_ms)} * 1000000] {
          while (SteadyNs() < until) {
          }
        });
      }
      for (const Waiting& w : batch) {
        w.resp->set_learner_version(round + 1);
        w.resp->set_adapter_sha256(std::string(64, 'a'));
        for (int m = 0; m < metrics_; ++m) (*w.resp->mutable_metrics())[absl::StrCat("metric_", m, ":sum")] = m * 0.5;
        w.reactor->Finish(grpc::Status::OK);
      }
      for (std::thread& t : busy) t.join();
      WriteAll(report_fd_, absl::StrCat("release ", round, " ", released, "\n"));
    }
  }
  const int runs_;
  const std::chrono::milliseconds hold_;
  const int metrics_, report_fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Waiting> waiting_;
  bool stopping_ = false;
  std::thread releaser_;
};

// Runs the server until stdin-like `stop_fd` closes; writes "port <p>" first.
void ServeUntilClosed(int runs, int report_fd, int stop_fd) {
  HoldingTrainer service(runs, std::chrono::milliseconds(absl::GetFlag(FLAGS_hold_ms)), absl::GetFlag(FLAGS_metrics),
                         report_fd);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) _exit(3);
  WriteAll(report_fd, absl::StrCat("port ", port, "\n"));
  char c;
  while (read(stop_fd, &c, 1) > 0) {
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

// Runs `mine` as threads of this process, each with its own TrainerClient; writes
// "recv <run> <round> <ns>" for every answer to `fd`.
int DriveRuns(const std::string& address, const std::vector<int>& mine, int rounds, int fd) {
  std::mutex out_mu;
  std::string lines;
  bool failed = false;
  std::vector<std::thread> threads;
  for (int r : mine) {
    threads.emplace_back([&, r] {
      auto client = TrainerClient::Connect(address, 30);
      if (!client.ok()) {
        std::lock_guard<std::mutex> lock(out_mu);
        failed = true;
        return;
      }
      (*client)->set_poll_for_answers(false);
      v1::TrainStepRequest req;
      req.set_run_id(absl::StrCat("run-", r));
      std::string mine_lines;
      for (int round = 0; round < rounds; ++round) {
        absl::StatusOr<v1::StepResponse> resp = (*client)->TrainStep(req);
        const int64_t received = SteadyNs();
        if (!resp.ok()) {
          std::lock_guard<std::mutex> lock(out_mu);
          failed = true;
          return;
        }
        absl::StrAppend(&mine_lines, "recv ", r, " ", round, " ", received, "\n");
      }
      std::lock_guard<std::mutex> lock(out_mu);
      lines += mine_lines;
    });
  }
  for (std::thread& t : threads) t.join();
  WriteAll(fd, lines);
  return failed ? 1 : 0;
}

// One layout against a fresh server process: per round, each answer's delay after the release.
absl::StatusOr<nlohmann::json> Measure(const std::string& layout, int runs, int rounds) {
  int report[2], stop[2], recv[2];
  if (pipe(report) != 0 || pipe(stop) != 0 || pipe(recv) != 0) return absl::InternalError("pipe");
  const pid_t server = fork();
  if (server == 0) {
    close(report[0]), close(stop[1]), close(recv[0]), close(recv[1]);
    ServeUntilClosed(runs, report[1], stop[0]);
    _exit(0);
  }
  close(report[1]), close(stop[0]);
  std::string head;
  char c;
  while (read(report[0], &c, 1) == 1 && c != '\n') head += c;
  if (head.rfind("port ", 0) != 0) return absl::InternalError("the server did not start");
  const std::string address = "127.0.0.1:" + head.substr(5);
  const int procs = layout == "processes" ? runs : 1;
  std::vector<pid_t> clients;
  for (int p = 0; p < procs; ++p) {
    std::vector<int> mine;
    for (int r = p; r < runs; r += procs) mine.push_back(r);
    const pid_t pid = fork();
    if (pid == 0) {
      close(recv[0]), close(report[0]), close(stop[1]);
      _exit(DriveRuns(address, mine, rounds + kWarmup, recv[1]));
    }
    clients.push_back(pid);
  }
  close(recv[1]);
  const std::string received = ReadAll(recv[0]);
  close(recv[0]);
  bool clients_ok = true;
  for (pid_t pid : clients) {
    int status = 0;
    waitpid(pid, &status, 0);
    clients_ok = clients_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  close(stop[1]);  // the server stops; its releases are all written by now
  const std::string releases = ReadAll(report[0]);
  close(report[0]);
  waitpid(server, nullptr, 0);
  if (!clients_ok) return absl::InternalError(layout + ": a client failed");
  std::map<int, int64_t> released;
  std::map<int, std::vector<double>> delays;  // round -> ms after the release, every run
  for (size_t at = 0; at < releases.size();) {
    const size_t end = releases.find('\n', at);
    int round = 0;
    long long ns = 0;
    if (std::sscanf(releases.c_str() + at, "release %d %lld", &round, &ns) == 2) released[round] = ns;
    at = end == std::string::npos ? releases.size() : end + 1;
  }
  for (size_t at = 0; at < received.size();) {
    const size_t end = received.find('\n', at);
    int run = 0, round = 0;
    long long ns = 0;
    if (std::sscanf(received.c_str() + at, "recv %d %d %lld", &run, &round, &ns) == 3 && round >= kWarmup &&
        released.count(round)) {
      delays[round].push_back((ns - released[round]) / 1e6);
    }
    at = end == std::string::npos ? received.size() : end + 1;
  }
  std::vector<double> medians, lasts;
  for (auto& [round, ms] : delays) {
    if (static_cast<int>(ms.size()) != runs) return absl::InternalError(layout + ": a round lost answers");
    medians.push_back(Quantile(ms, 0.5));
    lasts.push_back(*std::max_element(ms.begin(), ms.end()));
  }
  if (static_cast<int>(medians.size()) != rounds) return absl::InternalError(layout + ": rounds missing");
  return nlohmann::json{{"layout", layout},
                        {"client_processes", procs},
                        {"median_answer_ms", Quantile(medians, 0.5)},
                        {"last_answer_ms", Quantile(lasts, 0.5)},
                        {"last_answer_p90_ms", Quantile(lasts, 0.9)}};
}

int Main() {
  const int runs = absl::GetFlag(FLAGS_runs), rounds = absl::GetFlag(FLAGS_rounds);
  if (runs < 1 || rounds < 1) {
    std::fprintf(stderr, "--runs and --rounds must be positive\n");
    return 2;
  }
  nlohmann::json results = nlohmann::json::array();
  for (const std::string& layout : absl::GetFlag(FLAGS_layouts)) {
    if (layout != "threads" && layout != "processes") {
      std::fprintf(stderr, "--layouts: unknown layout '%s'\n", layout.c_str());
      return 2;
    }
    absl::StatusOr<nlohmann::json> r = Measure(layout, runs, rounds);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("%-13s %d runs: the median run's answer %.3f ms after the release, the last one's %.3f ms (p90 %.3f)\n",
                layout.c_str(), runs, (*r)["median_answer_ms"].get<double>(), (*r)["last_answer_ms"].get<double>(),
                (*r)["last_answer_p90_ms"].get<double>());
    results.push_back(*r);
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    nlohmann::ordered_json doc = BenchResultHeader();
    if (absl::GetFlag(FLAGS_versions).empty()) doc["library_versions"] = absl::StrCat("gRPC ", grpc::Version());
    doc["runs"] = runs;
    doc["rounds"] = rounds;
    doc["hold_ms"] = absl::GetFlag(FLAGS_hold_ms);
    doc["metrics_per_answer"] = absl::GetFlag(FLAGS_metrics);
    doc["busy_threads"] = absl::GetFlag(FLAGS_busy_threads);
    doc["busy_ms"] = absl::GetFlag(FLAGS_busy_ms);
    doc["method"] =
        "median over rounds of the median and the last run's delay from the server's release to the client's "
        "receipt; a fresh server process per layout";
    doc["layouts"] = results;
    std::ofstream file(out);
    file << doc.dump(1) << "\n";
    file.close();
    if (!file) {
      std::fprintf(stderr, "answer_fanout: --out %s: cannot write the result file\n", out.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace lorastep

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv,
                                   "answer_fanout [--runs 32] [--rounds 40] [--hold_ms 50] [--metrics 40] "
                                   "[--layouts threads,processes] [--out F.json]");
  return lorastep::Main();
}
