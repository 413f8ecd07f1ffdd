// Service overhead: the share of a TrainStep's client-observed time spent outside the
// worker's training compute (serialization, RPC, coordination, validation).
//   overhead = (client wall time - worker's time_step_s) / client wall time
// per step; the median over --steps steps after one warm-up step is reported.
//   service_overhead --address A --vocab V [--seqs 64] [--len 512] [--steps 5]
//                    [--out F.json] [--machine M] [--command C] [--key overhead_fraction_cpu]
//                    [--rank 32 (0 = full fine-tuning)] [--max_tokens 0 (worker default)]
//                    [--expert_lora per_expert|shared_outer (MoE)]
//                    [--batch_file B.json (bench/make_batch.py; else random --seqs x --len)]
//                    [--mode train|forward (Forward: log-probs only, no gradient)]
#include <algorithm>
#include <map>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>

#include "bench/bench_batch.h"
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
  const std::vector<v1::Datum> batch = flags.count("batch_file")
                                            ? LoadBatchFile(flags["batch_file"])
                                            : RandomBatch(seqs, len, vocab);
  const bool forward_only = get("mode", "train") == "forward";
  int64_t batch_tokens = 0;
  for (const auto& d : batch) batch_tokens += d.tokens_size();
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(1e-5);
  std::vector<double> fractions, client_s, worker_s;
  std::map<std::string, double> last_metrics;
  for (int s = 0; s <= steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    google::protobuf::Map<std::string, double> metrics;
    double compute = 0;
    if (forward_only) {
      auto r = run->Forward(batch);
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
      metrics = r->metrics();
      compute = metrics.at("time_forward_s:sum") + metrics.at("time_data_s:sum");
    } else {
      auto r = run->TrainStep(batch, loss, adamw, max_tokens);
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
      metrics = r->metrics();
      compute = metrics.at("time_step_s:sum");
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s == 0) continue;  // warm-up: allocator, kernels, caches
    last_metrics.clear();
    for (const auto& [k, v] : metrics) last_metrics[k] = v;
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
  j["batch"] = {{"sequences", batch.size()}, {"tokens", batch_tokens},
                {"batch_file", get("batch_file", "")}, {"lora_rank", lora.rank()},
                {"max_tokens_per_microbatch", max_tokens}, {"mode", forward_only ? "forward" : "train"}};
  j[get("key", "overhead_fraction")] = median;
  std::vector<double> worker_sorted = worker_s;
  std::sort(worker_sorted.begin(), worker_sorted.end());
  j["worker_step_median_s"] = worker_sorted[worker_sorted.size() / 2];
  j["tokens_per_s"] = batch_tokens / worker_sorted[worker_sorted.size() / 2];
  if (last_metrics.count("peak_cuda_memory_bytes:max")) {
    j["peak_cuda_gib"] = last_metrics["peak_cuda_memory_bytes:max"] / (1024.0 * 1024.0 * 1024.0);
  }
  j["client_step_s"] = client_s;
  j["worker_step_s"] = worker_s;
  j["last_step_metrics"] = last_metrics;
  j["overhead_fractions"] = fractions;
  j["method"] = "median over steps after one warm-up of (client wall - worker time_step_s) / client wall";
  if (flags.count("out")) std::ofstream(flags["out"]) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return 0;
}
