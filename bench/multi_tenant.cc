// Many runs on one base model (issue 30): --runs runs, each sending TrainSteps of --seqs x --len
// random tokens back to back from its own thread, all at once. Run against a worker with
// co-scheduling (--coschedule_window_us > 0) and against one without (0: the same calls served
// one at a time); bench/multi_tenant_results.py compares the two.
//   multi_tenant --address A --vocab V [--runs 16] [--seqs 8] [--len 512] [--steps 5]
//                [--ranks 32 (comma list, cycled over the runs)] [--label L] [--out F.json]
//                [--connection_per_run=false (one client connection for every run)] [--poll_for_answers]
// Every run first takes one warm-up step (all at once, not timed); then each thread sends
// --steps steps. Reported: aggregate tokens/s = runs x steps x tokens per call / the wall time
// from the start of the timed steps until the last answer; every call's latency (p50, p99);
// every run's loss and grad_norm per step (the warm-up step's first), for comparing the modes.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_batch.h"
#include "bench/bench_flags.h"
#include "clients/cpp/trainer_client.h"
#include "lib/flags_util.h"
#include "lib/hop_trace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, runs, 16, "runs, one sending thread each");
ABSL_FLAG(int, seqs, 8, "sequences per call");
ABSL_FLAG(int, len, 512, "tokens per sequence");
ABSL_FLAG(int, steps, 5, "timed steps per run (after one warm-up step)");
ABSL_FLAG(std::string, ranks, "32", "LoRA ranks, comma-separated, cycled over the runs");
ABSL_FLAG(std::string, label, "", "recorded in the JSON (for example the window)");
ABSL_FLAG(bool, connection_per_run, true,
          "each run its own client and connection, as separate tenants' loops have; false: one shared by all");
ABSL_FLAG(bool, poll_for_answers, false,
          "the clients poll for their answers near the expected time (TrainerClient's default); off by default "
          "here: the bench's clients share the service's host, and many of them polling at once take the cores "
          "the service answers with, where separate tenants' loops run on their own machines");

namespace {

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

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ParseCommandLineOrExit(argc, argv, "multi_tenant --address A --vocab V [--runs 16] [--seqs 8] [--len 512] [--steps 5]");
  const int runs = absl::GetFlag(FLAGS_runs), seqs = absl::GetFlag(FLAGS_seqs), len = absl::GetFlag(FLAGS_len),
            steps = absl::GetFlag(FLAGS_steps);
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
  auto client = TrainerClient::Connect(absl::GetFlag(FLAGS_address), 60);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 1;
  }
  const bool connection_per_run = absl::GetFlag(FLAGS_connection_per_run);
  std::vector<std::unique_ptr<TrainerClient>> run_clients;  // --connection_per_run
  std::vector<RunSession> sessions;
  std::vector<std::vector<v1::Datum>> batches;
  for (int r = 0; r < runs; ++r) {
    v1::LoraConfig lora;
    lora.set_rank(ranks[static_cast<size_t>(r) % ranks.size()]);
    lora.set_alpha(32);
    TrainerClient* via = client->get();
    (*client)->set_poll_for_answers(absl::GetFlag(FLAGS_poll_for_answers));
    if (connection_per_run) {
      auto own = TrainerClient::Connect(absl::GetFlag(FLAGS_address), 60);
      if (!own.ok()) {
        std::cerr << "run " << r << ": " << own.status() << "\n";
        return 1;
      }
      run_clients.push_back(*std::move(own));
      via = run_clients.back().get();
      via->set_poll_for_answers(absl::GetFlag(FLAGS_poll_for_answers));
    }
    auto run = RunSession::Create(via, lora, /*seed=*/static_cast<uint64_t>(r + 1));
    if (!run.ok()) {
      std::cerr << "run " << r << ": " << run.status() << "\n";
      return 1;
    }
    sessions.push_back(*std::move(run));
    batches.push_back(RandomBatch(seqs, len, absl::GetFlag(FLAGS_vocab), /*seed=*/static_cast<uint32_t>(r + 1)));
  }
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(1e-5);
  std::vector<RunRecord> records(static_cast<size_t>(runs));
  // Each thread sends `count` steps; returns when its run is done (or failed).
  auto send = [&](int r, int count, bool timed) {
    RunRecord& rec = records[static_cast<size_t>(r)];
    for (int s = 0; s < count && rec.error.empty(); ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      MarkHop("client_sent", sessions[static_cast<size_t>(r)].run_id());
      auto resp = sessions[static_cast<size_t>(r)].TrainStep(batches[static_cast<size_t>(r)], loss, adamw);
      MarkHop("client_answered", sessions[static_cast<size_t>(r)].run_id());
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < runs; ++r) threads.emplace_back(send, r, count, timed);
    for (auto& t : threads) t.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  all(1, false);  // warm-up: allocator, kernels, each run's optimizer state
  const double wall = all(steps, true);
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
  j["clients_poll_for_answers"] = absl::GetFlag(FLAGS_poll_for_answers);
  j["method"] = std::string("every run sends its steps back to back from its own thread, all runs at once, ") +
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
