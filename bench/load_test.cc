// Load test: N concurrent clients, each with its own run, send small TrainSteps to one
// coordinator until the total reaches --total_steps. Reports throughput, the p99 client step
// time, fairness (fewest steps of a client over most), the server processes' RSS growth
// between the end of a warm-up and the end, and lost state (a run whose learner_version is
// not its count of acknowledged steps).
//   load_test --address A --vocab V [--clients 16] [--total_steps 10000] [--warmup_steps 500]
//             [--pids P1,P2 (coordinator, workers)] [--out F.json]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"
#include "absl/flags/flag.h"
#include "lib/flags_util.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "coordinator host:port");
ABSL_FLAG(int64_t, vocab, 96, "vocabulary size of the served model");
ABSL_FLAG(int, clients, 16, "concurrent clients, one run each");
ABSL_FLAG(int64_t, total_steps, 10000, "TrainSteps in all");
ABSL_FLAG(int64_t, warmup_steps, 500, "steps before the RSS baseline");
ABSL_FLAG(std::string, pids, "", "coordinator and worker pids (comma-separated) whose RSS is measured");
ABSL_FLAG(std::string, out, "", "write the JSON result here");

namespace {

double RssMb(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ParseCommandLineOrExit(argc, argv, "load_test --address A --vocab V [--clients 16] [--total_steps 10000] [--warmup_steps 500] [--pids P1,P2] [--out F.json]");
  const std::string address = absl::GetFlag(FLAGS_address);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const int clients = absl::GetFlag(FLAGS_clients);
  const int64_t total = absl::GetFlag(FLAGS_total_steps), warmup = absl::GetFlag(FLAGS_warmup_steps);
  std::vector<std::string> pids;
  std::stringstream pid_list(absl::GetFlag(FLAGS_pids));
  for (std::string p; std::getline(pid_list, p, ',');) if (!p.empty()) pids.push_back(p);
  auto rss = [&] {
    double sum = 0;
    for (const auto& p : pids) sum += RssMb(p);
    return sum;
  };

  std::atomic<int64_t> started{0}, done{0};
  std::atomic<bool> warm{false};
  double rss_warm = 0;
  std::vector<double> rss_warm_per_process;
  std::mutex mu;
  std::vector<double> latencies;
  std::vector<int64_t> steps(clients, 0), versions(clients, -1);
  std::vector<std::string> errors;
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point t_warm = t0;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto client = TrainerClient::Connect(address, 60);
      if (!client.ok()) {
        std::lock_guard<std::mutex> l(mu);
        errors.push_back(client.status().ToString());
        return;
      }
      v1::LoraConfig lora;
      lora.set_rank(4);
      lora.set_alpha(8);
      auto run = RunSession::Create(client->get(), lora, c + 1);
      if (!run.ok()) {
        std::lock_guard<std::mutex> l(mu);
        errors.push_back(run.status().ToString());
        return;
      }
      v1::LossConfig loss;
      loss.set_loss_fn("ppo");
      v1::AdamWParams adamw;
      adamw.set_lr(1e-4);
      std::vector<double> mine;
      while (started.fetch_add(1) < total) {
        std::vector<v1::Datum> batch;
        for (int i = 0; i < 4; ++i) {
          v1::Datum& d = batch.emplace_back();
          for (int j = 0; j < 16; ++j) {
            d.add_tokens((c * 13 + i * 7 + j * 3 + steps[c]) % vocab);
            d.add_target_tokens((c * 5 + i * 5 + j * 11) % vocab);
            d.add_logprobs(-4.0f);
            d.add_advantages(j < 4 ? 0.0f : (i % 2 ? 1.0f : -1.0f));
          }
        }
        const auto s0 = std::chrono::steady_clock::now();
        auto r = run->TrainStep(batch, loss, adamw);
        mine.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
        if (!r.ok()) {
          std::lock_guard<std::mutex> l(mu);
          errors.push_back(r.status().ToString());
          continue;
        }
        ++steps[c];
        if (done.fetch_add(1) + 1 == warmup) {
          rss_warm = rss();
          for (const auto& p : pids) rss_warm_per_process.push_back(RssMb(p));
          t_warm = std::chrono::steady_clock::now();
          warm = true;
        }
      }
      auto state = (*client)->GetRun(run->run_id());
      if (state.ok()) versions[c] = state->learner_version();
      (*client)->DeleteRun(run->run_id()).IgnoreError();
      std::lock_guard<std::mutex> l(mu);
      latencies.insert(latencies.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  const auto t1 = std::chrono::steady_clock::now();
  const double rss_end = rss();
  std::sort(latencies.begin(), latencies.end());
  const auto [lo, hi] = std::minmax_element(steps.begin(), steps.end());
  int64_t lost = 0;
  for (int c = 0; c < clients; ++c) lost += versions[c] == steps[c] ? 0 : 1;
  const double measured_s = std::chrono::duration<double>(t1 - (warm ? t_warm : t0)).count();
  nlohmann::ordered_json j;
  j["concurrent_clients"] = clients;
  j["total_steps"] = done.load();
  j["steps_per_s"] = static_cast<double>(done.load() - (warm ? warmup : 0)) / measured_s;
  j["p50_step_s"] = latencies.empty() ? 0 : latencies[latencies.size() / 2];
  j["p99_step_s"] = latencies.empty() ? 0 : latencies[latencies.size() * 99 / 100];
  j["fairness_min_over_max"] = *hi > 0 ? static_cast<double>(*lo) / static_cast<double>(*hi) : 0.0;
  j["steps_per_client"] = steps;
  j["rss_warm_mb"] = rss_warm;
  j["rss_end_mb"] = rss_end;
  j["rss_growth_mb"] = rss_end - rss_warm;
  std::vector<double> per_process;
  for (const auto& p : pids) per_process.push_back(RssMb(p));
  j["rss_warm_mb_per_process"] = rss_warm_per_process;
  j["rss_end_mb_per_process"] = per_process;
  j["runs_with_lost_state"] = lost;
  j["errors"] = errors.size();
  if (!errors.empty()) j["first_error"] = errors.front();
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return errors.empty() && lost == 0 ? 0 : 1;
}
