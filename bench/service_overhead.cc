// Service overhead: the share of a TrainStep's client-observed time spent outside the
// worker's training compute (serialization, RPC, coordination, validation).
//   overhead = (client wall time - worker's time_step_s) / client wall time
// per step; the median over --steps steps after one warm-up step is reported.
//   service_overhead --address A --vocab V [--seqs 64] [--len 512] [--steps 5]
//                    [--out F.json] [--machine M] [--command C] [--key overhead_fraction_cpu]
//                    [--rank 32 (0 = full fine-tuning)] [--max_tokens 0 (worker default)]
//                    [--expert_lora per_expert|shared_outer (MoE)]
//                    [--batch_file B.json (bench/make_batch.py; else random --seqs x --len)]
//                    [--targets next|random (random batch: next-token targets, as RL sends, or
//                     targets of their own, sent whole)]
//                    [--mode train|forward (Forward: log-probs only, no gradient)]
//                    [--packed=false (datums as repeated Datum messages, not packed_datums)]
//                    [--first_step_logprobs (train: the warm-up step as ForwardBackward +
//                     OptimStep; its loss, grad_norm and per-token log-probs go into the JSON)]
#include <iterator>
#include <sstream>
#include <malloc.h>
#include <sys/resource.h>
#include <algorithm>
#include <map>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>

#include "bench/bench_batch.h"
#include "bench/bench_flags.h"
#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"
#include "absl/flags/flag.h"
#include "lib/flags_util.h"

ABSL_FLAG(int, seqs, 64, "sequences per batch (random batch)");
ABSL_FLAG(int, len, 512, "tokens per sequence (random batch)");
ABSL_FLAG(int, steps, 5, "steps (the first is warm-up)");
ABSL_FLAG(int64_t, rank, 32, "LoRA rank (0 = full fine-tuning)");
ABSL_FLAG(std::string, expert_lora, "", "MoE: per_expert (default) or shared_outer");
ABSL_FLAG(int64_t, max_tokens, 0, "padded tokens per micro-batch (0: the server's)");
ABSL_FLAG(std::string, batch_file, "", "a JSON batch instead of a random one");
ABSL_FLAG(std::string, targets, "next",
          "random batch: next (each sequence's targets are its tokens shifted by one, as in an RL rollout) "
          "or random (targets drawn apart from the tokens, so the client sends them whole)");
ABSL_FLAG(std::string, mode, "train", "train or forward");
ABSL_FLAG(std::string, key, "overhead_fraction", "JSON key of the median overhead");
ABSL_FLAG(bool, tune_malloc, false, "keep large buffers in this process's heap, as the servers do (TuneProcessForServing)");
ABSL_FLAG(int, server_pid, 0, "the coordinator's pid: its minor page faults per step go into the JSON too");
ABSL_FLAG(bool, client_poll, true,
          "the client polls for each step's answer inside the window it is expected in (TrainerClient::set_poll_for_answers)");
ABSL_FLAG(bool, packed, true, "send datums as packed_datums (false: repeated Datum messages)");
ABSL_FLAG(bool, first_step_logprobs, false,
          "train: run the warm-up step as ForwardBackward + OptimStep and record its loss, grad_norm and log-probs");

namespace {

// Minor page faults so far: of this process, or of `pid` (from /proc; -1 when unreadable).
int64_t MinorFaults(int pid) {
  if (pid == 0) {
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_minflt;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return -1;
  std::istringstream fields(text.substr(paren + 2));
  std::string field;
  for (int i = 0; i < 8 && fields >> field; ++i) {}  // state ... flags; then minflt (field 10)
  return fields >> field ? std::stoll(field) : -1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace lorastep;
  ParseCommandLineOrExit(argc, argv, "service_overhead --address A --vocab V [--seqs 64] [--len 512] [--steps 5] [--targets next|random] [--out F.json]");
  const std::string targets = absl::GetFlag(FLAGS_targets);
  if (targets != "next" && targets != "random") {
    std::cerr << "--targets: " << targets << " is neither next nor random\n";
    return 1;
  }
  if (absl::GetFlag(FLAGS_tune_malloc)) {  // as TuneProcessForServing (rpc/server_runner.cc)
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
  }
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const int seqs = absl::GetFlag(FLAGS_seqs), len = absl::GetFlag(FLAGS_len),
            steps = absl::GetFlag(FLAGS_steps);
  auto client = TrainerClient::Connect(absl::GetFlag(FLAGS_address), 60);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 1;
  }
  (*client)->set_poll_for_answers(absl::GetFlag(FLAGS_client_poll));
  v1::LoraConfig lora;
  lora.set_rank(absl::GetFlag(FLAGS_rank));  // 0 = full fine-tuning
  lora.set_alpha(32);
  lora.set_expert_lora(absl::GetFlag(FLAGS_expert_lora));  // MoE: per_expert (default) or shared_outer
  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  auto run = RunSession::Create(client->get(), lora, 0);
  if (!run.ok()) {
    std::cerr << run.status() << "\n";
    return 1;
  }
  run->pack_datums = absl::GetFlag(FLAGS_packed);
  const std::vector<v1::Datum> batch = !absl::GetFlag(FLAGS_batch_file).empty()
                                            ? LoadBatchFile(absl::GetFlag(FLAGS_batch_file))
                                            : RandomBatch(seqs, len, vocab, /*seed=*/1, targets == "next");
  const bool forward_only = absl::GetFlag(FLAGS_mode) == "forward";
  int64_t batch_tokens = 0;
  for (const auto& d : batch) batch_tokens += d.tokens_size();
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(1e-5);
  std::vector<double> fractions, client_s, worker_s;
  std::vector<int64_t> client_start_mono_us;  // each timed call's start on the host's monotonic clock
  std::vector<int64_t> client_faults, server_faults;  // minor page faults per step
  const int server_pid = absl::GetFlag(FLAGS_server_pid);
  std::map<std::string, double> last_metrics;
  std::vector<double> step_losses, step_grad_norms;  // every step's, the warm-up's first
  nlohmann::ordered_json first_step;
  for (int s = 0; s <= steps; ++s) {
    const int64_t faults0 = MinorFaults(0), server_faults0 = server_pid > 0 ? MinorFaults(server_pid) : -1;
    const auto t0 = std::chrono::steady_clock::now();
    auto t1 = t0;  // the call's return: this loop's own bookkeeping stays outside the timed call
    google::protobuf::Map<std::string, double> metrics;
    double compute = 0;
    if (forward_only) {
      auto r = run->Forward(batch);
      t1 = std::chrono::steady_clock::now();
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
      metrics = r->metrics();
      compute = metrics.at("time_forward_s:sum") + metrics.at("time_data_s:sum");
    } else if (s == 0 && absl::GetFlag(FLAGS_first_step_logprobs)) {
      auto fb = run->ForwardBackward(batch, loss);
      if (!fb.ok()) {
        std::cerr << fb.status() << "\n";
        return 1;
      }
      auto r = run->OptimStep(adamw);
      t1 = std::chrono::steady_clock::now();
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
      metrics = fb->metrics();
      for (const auto& [k, v] : r->metrics()) metrics[k] = v;
      std::vector<float> logprobs;
      for (const auto& datum : fb->logprobs()) logprobs.insert(logprobs.end(), datum.values().begin(), datum.values().end());
      first_step["loss"] = metrics.at("loss:sum");
      first_step["grad_norm"] = metrics.at("grad_norm:sum");
      first_step["logprobs"] = logprobs;
    } else {
      auto r = run->TrainStep(batch, loss, adamw, max_tokens);
      t1 = std::chrono::steady_clock::now();
      if (!r.ok()) {
        std::cerr << r.status() << "\n";
        return 1;
      }
      metrics = r->metrics();
      compute = metrics.at("time_step_s:sum");
    }
    if (!forward_only) {
      step_losses.push_back(metrics.count("loss:sum") ? metrics.at("loss:sum") : std::nan(""));
      step_grad_norms.push_back(metrics.count("grad_norm:sum") ? metrics.at("grad_norm:sum") : std::nan(""));
    }
    const double wall = std::chrono::duration<double>(t1 - t0).count();
    if (s == 0) continue;  // warm-up: allocator, kernels, caches
    client_faults.push_back(MinorFaults(0) - faults0);
    if (server_pid > 0) server_faults.push_back(MinorFaults(server_pid) - server_faults0);
    last_metrics.clear();
    for (const auto& [k, v] : metrics) last_metrics[k] = v;
    client_s.push_back(wall);
    client_start_mono_us.push_back(
        std::chrono::duration_cast<std::chrono::microseconds>(t0.time_since_epoch()).count());
    worker_s.push_back(compute);
    fractions.push_back((wall - compute) / wall);
  }
  std::vector<double> sorted = fractions;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  nlohmann::ordered_json j = BenchResultHeader();
  j["batch"] = {{"sequences", batch.size()}, {"tokens", batch_tokens},
                {"batch_file", absl::GetFlag(FLAGS_batch_file)}, {"lora_rank", lora.rank()},
                {"max_tokens_per_microbatch", max_tokens}, {"mode", forward_only ? "forward" : "train"},
                {"datums_form", run->pack_datums ? "packed_datums" : "datums"},
                {"targets", absl::GetFlag(FLAGS_batch_file).empty() ? targets : "batch_file"}};
  j[absl::GetFlag(FLAGS_key)] = median;
  std::vector<double> worker_sorted = worker_s;
  std::sort(worker_sorted.begin(), worker_sorted.end());
  j["worker_step_median_s"] = worker_sorted[worker_sorted.size() / 2];
  j["tokens_per_s"] = batch_tokens / worker_sorted[worker_sorted.size() / 2];
  if (last_metrics.count("peak_cuda_memory_bytes:max")) {
    j["peak_cuda_gib"] = last_metrics["peak_cuda_memory_bytes:max"] / (1024.0 * 1024.0 * 1024.0);
  }
  j["client_step_s"] = client_s;
  // With the servers' --v=2 lines (end_mono_us, duration_ms) these split each call into the
  // client's side and each server's (bench/service_split.py).
  j["client_start_mono_us"] = client_start_mono_us;
  j["worker_step_s"] = worker_s;
  j["last_step_metrics"] = last_metrics;
  if (!forward_only) {
    j["step_losses"] = step_losses;  // the warm-up step's first
    j["step_grad_norms"] = step_grad_norms;
  }
  if (!first_step.empty()) j["first_step"] = first_step;
  j["overhead_fractions"] = fractions;
  j["client_minor_faults"] = client_faults;
  if (server_pid > 0) j["server_minor_faults"] = server_faults;
  j["method"] = "median over steps after one warm-up of (client wall - worker time_step_s) / client wall";
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out)) << j.dump(2) << "\n";
  std::cout << j.dump(2) << "\n";
  return 0;
}
