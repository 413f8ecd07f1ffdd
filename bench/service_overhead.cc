// Service overhead: the share of a TrainStep's client-observed time spent outside the
// worker's training compute (serialization, RPC, coordination, validation).
//   overhead = (client wall time - worker's time_step_s) / client wall time
// per step; the median over --steps steps after one warm-up step is reported.
//   service_overhead --address A --vocab V [--seqs 64] [--len 512] [--steps 5]
//                    [--out F.json] [--machine M] [--command C] [--key overhead_fraction_cpu]
//                    [--rank 32 (0 = full fine-tuning)] [--max_tokens 0 (worker default)]
//                    [--expert_lora per_expert|shared_outer (MoE)]
#include <algorithm>
#include <map>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <random>

#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"
#include "rpc/server_runner.h"

int main(int argc, char** argv) {
  using namespace lorastep;
  auto flags = ParseFlags(argc, argv);
  auto get = [&](const char* k, const std::string& d) { return flags.count(k) ? flags[k] : d; };
  const int64_t vocab = std::stoll(get("vocab", "96"));
  const int seqs = std::stoi(get("seqs", "64")), len = std::stoi(get("len", "512")),
            steps = std::stoi(get("steps", "5"));
  auto client = TrainerClient::Connect(get("address", "127.0.0.1:50051"), 60);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 1;
  }
  v1::LoraConfig lora;
  lora.set_rank(std::stoll(get("rank", "32")));  // 0 = full fine-tuning
  lora.set_alpha(32);
  lora.set_expert_lora(get("expert_lora", ""));  // MoE: per_expert (default) or shared_outer
  const int64_t max_tokens = std::stoll(get("max_tokens", "0"));
  auto run = RunSession::Create(client->get(), lora, 0);
  if (!run.ok()) {
    std::cerr << run.status() << "\n";
    return 1;
  }
  std::mt19937 rng(1);
  std::vector<v1::Datum> batch(seqs);
  for (auto& d : batch) {
    for (int i = 0; i < len; ++i) {
      d.add_tokens(rng() % vocab);
      d.add_target_tokens(rng() % vocab);
      d.add_logprobs(-5.0f);
      d.add_advantages(i < len / 4 ? 0.0f : ((rng() % 2) ? 1.0f : -1.0f));
    }
  }
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(1e-5);
  std::vector<double> fractions, client_s, worker_s;
  std::map<std::string, double> last_metrics;
  for (int s = 0; s <= steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    auto r = run->TrainStep(batch, loss, adamw, max_tokens);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return 1;
    }
    if (s == 0) continue;  // warm-up: allocator, kernels, caches
    const double compute = r->metrics().at("time_step_s:sum");
    last_metrics.clear();
    for (const auto& [k, v] : r->metrics()) last_metrics[k] = v;
    client_s.push_back(wall);
    worker_s.push_back(compute);
    fractions.push_back((wall - compute) / wall);
  }
  std::vector<double> sorted = fractions;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::ordered_json j;
  j["date"] = date;
  j["machine"] = get("machine", "unknown");
  j["library_versions"] = get("versions", "");
  j["command"] = get("command", "");
  j["model"] = get("model", "");
  j["batch"] = {{"sequences", seqs}, {"tokens_per_sequence", len}, {"lora_rank", lora.rank()},
                {"max_tokens_per_microbatch", max_tokens}};
  j[get("key", "overhead_fraction")] = median;
  j["client_step_s"] = client_s;
  j["worker_step_s"] = worker_s;
  j["last_step_metrics"] = last_metrics;
  j["overhead_fractions"] = fractions;
  j["method"] = "median over steps after one warm-up of (client wall - worker time_step_s) / client wall";
  if (flags.count("out")) std::ofstream(flags["out"]) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return 0;
}
