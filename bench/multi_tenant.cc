// Many runs on one base model (issue 30): --runs runs, each sending TrainSteps of --seqs x --len
// random tokens back to back from its own thread, all at once. Run against a worker with
// co-scheduling (--coschedule_window_us > 0) and against one without (0: the same calls served
// one at a time); bench/multi_tenant_results.py compares the two.
//   multi_tenant --address A --vocab V [--runs 16] [--seqs 8] [--len 512] [--steps 5]
//                [--ranks 32 (comma list, cycled over the runs)] [--label L] [--out F.json]
//                [--connection_per_run=false (one client connection for every run)] [--poll_for_answers]
//                [--client_procs N (the runs' loops in N forked client processes)]
// Every run first takes one warm-up step (all at once, not timed); then each thread sends
// --steps steps. Reported: aggregate tokens/s = runs x steps x tokens per call / the wall time
// from the start of the timed steps until the last answer; every call's latency (p50, p99);
// every run's loss and grad_norm per step (the warm-up step's first), for comparing the modes.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_batch.h"
#include "bench/bench_flags.h"
#include "bench/bench_stats.h"
#include "clients/cpp/trainer_client.h"
#include "lib/flags_util.h"
#include "lib/hop_trace.h"
#include "lib/status_macros.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, runs, 16, "runs, one sending thread each");
ABSL_FLAG(int, seqs, 8, "sequences per call");
ABSL_FLAG(int, len, 512, "tokens per sequence");
ABSL_FLAG(int, steps, 5, "timed steps per run (after one warm-up step)");
ABSL_FLAG(std::string, ranks, "32", "LoRA ranks, comma-separated, cycled over the runs");
ABSL_FLAG(std::string, label, "", "recorded in the JSON (for example the window)");
ABSL_FLAG(bool, connection_per_run, true,
          "each run its own client and connection, as separate tenants' loops have; false: one shared by all");
ABSL_FLAG(int, client_procs, 1,
          "client processes the runs' loops are split over (run r in process r mod N), as separate tenants' loops "
          "are; 1: every run a thread of this process");
ABSL_FLAG(bool, poll_for_answers, false,
          "the clients poll for their answers near the expected time (TrainerClient's default); off by default "
          "here: the bench's clients share the service's host, and many of them polling at once take the cores "
          "the service answers with, where separate tenants' loops run on their own machines");

namespace {

using lorastep::RunSession;
using lorastep::TrainerClient;
namespace v1 = lorastep::v1;

// Per-call metrics averaged over every timed call of every run (where a response has them).
const char* const kPhaseMetrics[] = {"time_step_s:sum", "time_coschedule_wait_s:sum",
                                     "time_coschedule_last_arrival_s:sum", "time_coschedule_between_steps_s:sum",
                                     "co_scheduled_missed_runs:max",
                                     "time_forward_backward_joint_s:sum", "time_optimizer_s:sum",
                                     "time_grad_finalize_s:sum", "time_digest_s:sum", "co_scheduled_rows:sum",
                                     "co_scheduled_row_tokens:max", "co_scheduled_tokens:max"};

struct RunRecord {
  std::vector<double> latencies_s;  // timed steps
  std::vector<double> losses, grad_norms, co_scheduled_runs;  // every step, the warm-up's first
  std::map<std::string, std::vector<double>> phases;          // timed steps, kPhaseMetrics
  std::string error;
};

using lorastep::Quantile;
using lorastep::SteadyNs;

// What every client process needs to drive its runs.
struct DriveOptions {
  std::string address;
  int64_t vocab = 0;
  int seqs = 0, len = 0, steps = 0;
  std::vector<int64_t> ranks;
  bool connection_per_run = true, poll_for_answers = false;
};

// Drives runs `mine` (global indices into `records`) from this process: creates them, one
// warm-up step each (all at once), then `between()` (the other client processes' barrier),
// then the timed steps; [*t0, *t1] the timed phase on the steady clock (ns).
absl::Status DriveRuns(const DriveOptions& o, const std::vector<int>& mine, const std::function<void()>& between,
                       std::vector<RunRecord>* records, int64_t* t0, int64_t* t1) {
  std::vector<std::unique_ptr<TrainerClient>> clients;  // one per run, or one for all
  std::map<int, RunSession> sessions;
  std::map<int, std::vector<v1::Datum>> batches;
  for (int r : mine) {
    v1::LoraConfig lora;
    lora.set_rank(o.ranks[static_cast<size_t>(r) % o.ranks.size()]);
    lora.set_alpha(32);
    if (clients.empty() || o.connection_per_run) {
      LORASTEP_ASSIGN_OR_RETURN(std::unique_ptr<TrainerClient> client, TrainerClient::Connect(o.address, 60));
      client->set_poll_for_answers(o.poll_for_answers);
      clients.push_back(std::move(client));
    }
    TrainerClient* via = clients.back().get();
    absl::StatusOr<RunSession> run = RunSession::Create(via, lora, /*seed=*/static_cast<uint64_t>(r + 1));
    if (!run.ok()) return absl::Status(run.status().code(), absl::StrCat("run ", r, ": ", run.status().message()));
    sessions.emplace(r, *std::move(run));
    batches.emplace(r, lorastep::RandomBatch(o.seqs, o.len, o.vocab, /*seed=*/static_cast<uint32_t>(r + 1)));
  }
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(1e-5);
  // Each thread sends `count` steps; returns when its run is done (or failed).
  auto send = [&](int r, int count, bool timed) {
    RunRecord& rec = (*records)[static_cast<size_t>(r)];
    RunSession& session = sessions.at(r);
    for (int s = 0; s < count && rec.error.empty(); ++s) {
      const auto sent = std::chrono::steady_clock::now();
      lorastep::MarkHop("client_sent", session.run_id());
      auto resp = session.TrainStep(batches.at(r), loss, adamw);
      lorastep::MarkHop("client_answered", session.run_id());
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
      if (!resp.ok()) {
        rec.error = resp.status().ToString();
        return;
      }
      const auto& m = resp->metrics();
      if (timed) {
        rec.latencies_s.push_back(wall);
        for (const char* name : kPhaseMetrics) {
          if (m.count(name)) rec.phases[name].push_back(m.at(name));
        }
      }
      rec.losses.push_back(m.count("loss:sum") ? m.at("loss:sum") : 0.0);
      rec.grad_norms.push_back(m.count("grad_norm:sum") ? m.at("grad_norm:sum") : 0.0);
      rec.co_scheduled_runs.push_back(m.count("co_scheduled_runs:max") ? m.at("co_scheduled_runs:max") : 1.0);
    }
  };
  auto all = [&](int count, bool timed) {
    std::vector<std::thread> threads;
    for (int r : mine) threads.emplace_back(send, r, count, timed);
    for (auto& t : threads) t.join();
  };
  all(1, false);  // warm-up: allocator, kernels, each run's optimizer state
  if (between) between();
  *t0 = SteadyNs();
  all(o.steps, true);
  *t1 = SteadyNs();
  return absl::OkStatus();
}

nlohmann::json RecordToJson(const RunRecord& rec) {
  return {{"latencies_s", rec.latencies_s}, {"losses", rec.losses},  {"grad_norms", rec.grad_norms},
          {"co_scheduled_runs", rec.co_scheduled_runs}, {"phases", rec.phases}, {"error", rec.error}};
}

RunRecord RecordFromJson(const nlohmann::json& j) {
  RunRecord rec;
  j.at("latencies_s").get_to(rec.latencies_s);
  j.at("losses").get_to(rec.losses);
  j.at("grad_norms").get_to(rec.grad_norms);
  j.at("co_scheduled_runs").get_to(rec.co_scheduled_runs);
  j.at("phases").get_to(rec.phases);
  j.at("error").get_to(rec.error);
  return rec;
}

// Reads one byte from `fd`, waiting at most `timeout`; false on a timeout, an error or the end.
bool ReadByte(int fd, std::chrono::seconds timeout) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(std::chrono::milliseconds(timeout).count())) <= 0) return false;
  char byte = 0;
  return read(fd, &byte, 1) == 1;
}

// DriveRuns in `procs` forked client processes (run r in process r mod procs), as separate
// tenants' loops are: each creates its runs and takes its warm-up steps, then all start their
// timed steps together (a pipe barrier) and each writes its records to a file this process
// reads. Forked before this process makes any gRPC object.
absl::Status DriveRunsInProcesses(const DriveOptions& o, int runs, int procs, std::vector<RunRecord>* records,
                                  int64_t* t0, int64_t* t1) {
  char folder_template[] = "/tmp/multi_tenant_XXXXXX";
  const char* folder = mkdtemp(folder_template);
  if (folder == nullptr) return absl::InternalError("mkdtemp failed");
  int ready[2], go[2];
  if (pipe(ready) != 0 || pipe(go) != 0) return absl::InternalError("pipe failed");
  std::vector<pid_t> children;
  for (int k = 0; k < procs; ++k) {
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      close(ready[0]);
      close(go[1]);
      std::vector<int> mine;
      for (int r = k; r < runs; r += procs) mine.push_back(r);
      std::vector<RunRecord> mine_records(static_cast<size_t>(runs));
      int64_t start = 0, end = 0;
      const absl::Status s = DriveRuns(o, mine, [&] {
        (void)!write(ready[1], "r", 1);
        ReadByte(go[0], std::chrono::seconds(3600));
      }, &mine_records, &start, &end);
      nlohmann::json part = {{"error", s.ok() ? "" : s.ToString()}, {"t0", start}, {"t1", end}};
      for (int r : mine) part["records"][std::to_string(r)] = RecordToJson(mine_records[static_cast<size_t>(r)]);
      std::ofstream(absl::StrCat(folder, "/", k, ".json")) << part.dump() << "\n";
      if (!s.ok()) (void)!write(ready[1], "r", 1);  // failed before the barrier: do not hold the others
      _exit(s.ok() ? 0 : 1);
    }
    children.push_back(pid);
  }
  close(ready[1]);
  close(go[0]);
  // Every process's warm-up done; a process that exits before the barrier failed, and the
  // others are stopped rather than left waiting for it.
  int arrived = 0;
  bool ended_early = false;
  std::vector<bool> reaped(children.size(), false);
  while (arrived < procs && !ended_early) {
    if (ReadByte(ready[0], std::chrono::seconds(1))) {
      ++arrived;
      continue;
    }
    for (size_t k = 0; k < children.size(); ++k) {
      int exit_status = 0;
      if (!reaped[k] && waitpid(children[k], &exit_status, WNOHANG) == children[k]) reaped[k] = ended_early = true;
    }
  }
  if (ended_early) {
    for (size_t k = 0; k < children.size(); ++k) {
      if (!reaped[k]) kill(children[k], SIGKILL);
    }
  }
  for (int k = 0; k < procs; ++k) (void)!write(go[1], "g", 1);
  close(go[1]);
  close(ready[0]);
  absl::Status status = ended_early ? absl::InternalError("a client process ended before the timed steps")
                                    : absl::OkStatus();
  *t0 = std::numeric_limits<int64_t>::max();
  *t1 = 0;
  for (int k = 0; k < procs; ++k) {
    int exit_status = 0;
    if (!reaped[static_cast<size_t>(k)]) waitpid(children[static_cast<size_t>(k)], &exit_status, 0);
    std::ifstream file(absl::StrCat(folder, "/", k, ".json"));
    nlohmann::json part = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
    if (part.is_discarded() || !part.contains("records")) {
      status.Update(absl::InternalError(absl::StrCat("client process ", k, " left no records")));
      continue;
    }
    if (!part["error"].get<std::string>().empty()) {
      status.Update(absl::InternalError(part["error"].get<std::string>()));
    }
    *t0 = std::min(*t0, part["t0"].get<int64_t>());
    *t1 = std::max(*t1, part["t1"].get<int64_t>());
    for (auto& [r, rec] : part["records"].items()) (*records)[std::stoul(r)] = RecordFromJson(rec);
    std::remove(absl::StrCat(folder, "/", k, ".json").c_str());
  }
  rmdir(folder);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ParseCommandLineOrExit(argc, argv, "multi_tenant --address A --vocab V [--runs 16] [--seqs 8] [--len 512] [--steps 5]");
  const int runs = absl::GetFlag(FLAGS_runs), seqs = absl::GetFlag(FLAGS_seqs), len = absl::GetFlag(FLAGS_len),
            steps = absl::GetFlag(FLAGS_steps), procs = absl::GetFlag(FLAGS_client_procs);
  std::vector<int64_t> ranks;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int64_t rank = 0;
    if (!absl::SimpleAtoi(r, &rank) || rank <= 0) {
      std::cerr << "--ranks: '" << r << "' is not a positive integer\n";
      return 2;
    }
    ranks.push_back(rank);
  }
  if (runs <= 0 || seqs <= 0 || len <= 1 || steps <= 0) {
    std::cerr << "--runs, --seqs and --steps must be positive and --len above 1\n";
    return 2;
  }
  if (procs <= 0 || procs > runs) {
    std::cerr << "--client_procs must be between 1 and --runs\n";
    return 2;
  }
  const bool connection_per_run = absl::GetFlag(FLAGS_connection_per_run);
  DriveOptions options{absl::GetFlag(FLAGS_address), absl::GetFlag(FLAGS_vocab), seqs, len, steps, ranks,
                       connection_per_run, absl::GetFlag(FLAGS_poll_for_answers)};
  std::vector<RunRecord> records(static_cast<size_t>(runs));
  int64_t t0 = 0, t1 = 0;
  absl::Status driven;
  if (procs == 1) {
    std::vector<int> all_runs;
    for (int r = 0; r < runs; ++r) all_runs.push_back(r);
    driven = DriveRuns(options, all_runs, nullptr, &records, &t0, &t1);
  } else {
    driven = DriveRunsInProcesses(options, runs, procs, &records, &t0, &t1);
  }
  if (!driven.ok()) {
    std::cerr << "multi_tenant: " << driven << "\n";
    return 1;
  }
  const double wall = static_cast<double>(t1 - t0) / 1e9;
  for (int r = 0; r < runs; ++r) {
    if (!records[static_cast<size_t>(r)].error.empty()) {
      std::cerr << "run " << r << ": " << records[static_cast<size_t>(r)].error << "\n";
      return 1;
    }
  }
  std::vector<double> latencies, occupancy;
  nlohmann::ordered_json per_run = nlohmann::json::array();
  for (const RunRecord& rec : records) {
    latencies.insert(latencies.end(), rec.latencies_s.begin(), rec.latencies_s.end());
    occupancy.insert(occupancy.end(), rec.co_scheduled_runs.begin() + 1, rec.co_scheduled_runs.end());
    per_run.push_back({{"losses", rec.losses}, {"grad_norms", rec.grad_norms}, {"latencies_s", rec.latencies_s}});
  }
  nlohmann::ordered_json phase_means;
  for (const char* name : kPhaseMetrics) {
    double sum = 0, count = 0;
    for (const RunRecord& rec : records) {
      auto it = rec.phases.find(name);
      if (it == rec.phases.end()) continue;
      for (double v : it->second) sum += v, ++count;
    }
    if (count > 0) phase_means[name] = sum / count;
  }
  double occupancy_mean = 0;
  for (double o : occupancy) occupancy_mean += o / static_cast<double>(occupancy.size());
  const int64_t tokens_per_call = static_cast<int64_t>(seqs) * len;
  nlohmann::ordered_json j = BenchResultHeader();
  j["label"] = absl::GetFlag(FLAGS_label);
  j["runs"] = runs;
  j["tokens_per_call"] = tokens_per_call;
  j["calls"] = {{"sequences", seqs}, {"length", len}, {"ranks", ranks}, {"loss", "ppo"}};
  j["timed_steps_per_run"] = steps;
  j["wall_s"] = wall;
  j["aggregate_tokens_per_s"] = static_cast<double>(runs) * steps * static_cast<double>(tokens_per_call) / wall;
  j["latency_p50_s"] = Quantile(latencies, 0.5);
  j["latency_p99_s"] = Quantile(latencies, 0.99);
  j["co_scheduled_runs_mean"] = occupancy_mean;
  j["per_call_metric_means"] = phase_means;
  j["per_run"] = per_run;
  j["connection_per_run"] = connection_per_run;
  j["client_processes"] = procs;
  j["clients_poll_for_answers"] = absl::GetFlag(FLAGS_poll_for_answers);
  j["method"] = std::string("every run sends its steps back to back from its own thread, all runs at once, ") +
                (procs > 1 ? absl::StrCat("the runs split over ", procs, " client processes, ") : std::string()) +
                (connection_per_run ? "each over its own client connection" : "all over one client connection") +
                (absl::GetFlag(FLAGS_poll_for_answers) ? ", the clients polling for their answers"
                                                        : ", the clients blocking for their answers") +
                "; aggregate tokens/s over the timed steps' wall time (after one warm-up step per run); latency per "
                "call, all runs";
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream file(out);
    file << j.dump(2) << "\n";
    file.close();
    if (!file) {
      std::cerr << "multi_tenant: --out " << out << ": cannot write the result file\n";
      return 1;
    }
  }
  nlohmann::ordered_json summary = j;
  summary.erase("per_run");
  std::cout << summary.dump(2) << "\n";
  return 0;
}
