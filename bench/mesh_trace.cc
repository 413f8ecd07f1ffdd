// One run's trace through a coordinator, for comparing parallel layouts with world size 1
// (bench/multi_gpu.sh, bench/multi_gpu_results.py): a fresh LoRA run (fixed seed), --steps
// TrainSteps on one batch (PPO), each step's loss, grad_norm, replica hashes and client wall
// time; then Forward log-probs of the batch and the exported PEFT adapter. The first
// --compare_steps steps are the ones compared; tokens/s is the batch over the median client
// wall time of the steps after the first (warm-up).
//   mesh_trace --address A --out F.json [--batch_file B.json | --seqs N --len L --vocab V]
//              [--rank 32] [--alpha 32] [--expert_lora shared_outer] [--steps 6] [--lr 1e-4]
//              [--max_tokens 0] [--export_dir D] [--label L]
// With --kill_cmd C --kill_after_ms M it instead checks a worker killed mid-step: after one
// healthy step it starts a TrainStep, runs C (e.g. a pkill of one rank's worker) M ms in,
// and records the call's status and the run's learner_version and next_sequence_id before
// and after (nothing may be applied).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <thread>

#include "bench/bench_batch.h"
#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"
#include "absl/flags/flag.h"
#include "bench/bench_stats.h"
#include "lib/flags_util.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "coordinator host:port");
ABSL_FLAG(std::string, out, "", "write the JSON trace here; required");
ABSL_FLAG(std::string, batch_file, "", "a JSON batch instead of a random one");
ABSL_FLAG(int, seqs, 64, "sequences per batch (random batch)");
ABSL_FLAG(int, len, 512, "tokens per sequence (random batch)");
ABSL_FLAG(int64_t, vocab, 96, "vocabulary size (random batch)");
ABSL_FLAG(int64_t, rank, 32, "LoRA rank");
ABSL_FLAG(double, alpha, 32, "LoRA alpha");
ABSL_FLAG(std::string, expert_lora, "", "MoE: per_expert (default) or shared_outer");
ABSL_FLAG(double, lr, 1e-4, "AdamW learning rate");
ABSL_FLAG(int64_t, max_tokens, 0, "padded tokens per micro-batch (0: the server's)");
ABSL_FLAG(std::string, label, "", "recorded in the JSON");
ABSL_FLAG(std::string, kill_cmd, "", "instead: run this command mid-step (a killed worker) and record the call");
ABSL_FLAG(int, kill_after_ms, 100, "with --kill_cmd: ms into the step");
ABSL_FLAG(int, steps, 6, "TrainSteps");
ABSL_FLAG(std::string, export_dir, "", "export the adapter here after the steps");

namespace lorastep {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Fail(const absl::Status& s, const char* what) {
  std::cerr << "mesh_trace: " << what << ": " << s << "\n";
  return 1;
}

nlohmann::ordered_json RunJson(const v1::Run& run) {
  return {{"learner_version", run.learner_version()}, {"next_sequence_id", run.next_sequence_id()}};
}

}  // namespace

int Main(int argc, char** argv) {
  ParseCommandLineOrExit(argc, argv, "mesh_trace --address A --out F.json [--batch_file B.json | --seqs N --len L --vocab V] [flags]");
  if (absl::GetFlag(FLAGS_out).empty()) {
    std::cerr << "mesh_trace: --out is required\n";
    return 2;
  }
  const std::vector<v1::Datum> batch =
      !absl::GetFlag(FLAGS_batch_file).empty() ? LoadBatchFile(absl::GetFlag(FLAGS_batch_file))
                                : RandomBatch(absl::GetFlag(FLAGS_seqs), absl::GetFlag(FLAGS_len),
                                              absl::GetFlag(FLAGS_vocab));
  int64_t batch_tokens = 0;
  for (const auto& d : batch) batch_tokens += d.tokens_size();
  auto client = TrainerClient::Connect(absl::GetFlag(FLAGS_address), 120);
  if (!client.ok()) return Fail(client.status(), "connect");
  v1::LoraConfig lora;
  lora.set_rank(absl::GetFlag(FLAGS_rank));
  lora.set_alpha(absl::GetFlag(FLAGS_alpha));
  lora.set_expert_lora(absl::GetFlag(FLAGS_expert_lora));
  auto run = RunSession::Create(client->get(), lora, /*seed=*/7);
  if (!run.ok()) return Fail(run.status(), "CreateRun");
  v1::LossConfig loss;
  loss.set_loss_fn("ppo");
  v1::AdamWParams adamw;
  adamw.set_lr(absl::GetFlag(FLAGS_lr));
  adamw.set_weight_decay(0.01);
  adamw.set_max_grad_norm(1.0);
  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);

  nlohmann::ordered_json j;
  j["date"] = lorastep::UtcNowIso();
  j["label"] = absl::GetFlag(FLAGS_label);
  j["batch"] = {{"sequences", batch.size()}, {"tokens", batch_tokens}, {"batch_file", absl::GetFlag(FLAGS_batch_file)},
                {"lora_rank", lora.rank()}, {"expert_lora", lora.expert_lora()},
                {"max_tokens_per_microbatch", max_tokens}, {"lr", adamw.lr()}};

  if (!absl::GetFlag(FLAGS_kill_cmd).empty()) {
    auto first = run->TrainStep(batch, loss, adamw, max_tokens);
    if (!first.ok()) return Fail(first.status(), "first TrainStep");
    auto before = client->get()->GetRun(run->run_id());
    if (!before.ok()) return Fail(before.status(), "GetRun");
    run->max_attempts = 1;
    const int after_ms = absl::GetFlag(FLAGS_kill_after_ms);
    const std::string cmd = absl::GetFlag(FLAGS_kill_cmd);
    int kill_rc = -1;
    std::thread killer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(after_ms));
      kill_rc = std::system(cmd.c_str());
    });
    const auto t0 = std::chrono::steady_clock::now();
    auto r = run->TrainStep(batch, loss, adamw, max_tokens);
    const double call_s = Seconds(t0);
    killer.join();
    auto after = client->get()->GetRun(run->run_id());
    if (!after.ok()) return Fail(after.status(), "GetRun after the kill");
    j["kill"] = {{"command", cmd},
                 {"after_ms", after_ms},
                 {"kill_rc", kill_rc},
                 {"call_ok", r.ok()},
                 {"call_s", call_s},
                 {"code", absl::StatusCodeToString(r.status().code())},
                 {"message", std::string(r.status().message())},
                 {"before", RunJson(*before)},
                 {"after", RunJson(*after)},
                 {"nothing_applied", !r.ok() && before->learner_version() == after->learner_version() &&
                                         before->next_sequence_id() == after->next_sequence_id()}};
    std::ofstream(absl::GetFlag(FLAGS_out)) << j.dump(2) << "\n";
    std::cout << j["kill"].dump(2) << "\n";
    return 0;
  }

  const int steps = absl::GetFlag(FLAGS_steps);
  std::vector<double> wall;
  for (int s = 0; s < steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = run->TrainStep(batch, loss, adamw, max_tokens);
    if (!r.ok()) return Fail(r.status(), "TrainStep");
    const double w = Seconds(t0);
    if (s > 0) wall.push_back(w);
    nlohmann::ordered_json step = {{"loss", r->metrics().at("loss:sum")},
                                   {"grad_norm", r->metrics().at("grad_norm:sum")},
                                   {"replicas_equal", r->replicas_equal()},
                                   {"client_s", w},
                                   {"learner_version", r->learner_version()}};
    nlohmann::ordered_json hashes = nlohmann::ordered_json::array();
    for (const auto& h : r->replica_hashes()) {
      hashes.push_back({{"stage", h.stage()}, {"family", h.family()}, {"equal", h.equal()},
                        {"ranks", std::vector<int>(h.ranks().begin(), h.ranks().end())},
                        {"sha256", h.sha256().substr(0, 16)}});
    }
    step["replica_hashes"] = hashes;
    for (const auto& [k, v] : r->metrics()) {  // per-phase times and the CUDA peak
      if (k.rfind("time_", 0) == 0 || k == "peak_cuda_memory_bytes:max") step[k] = v;
    }
    j["steps"].push_back(step);
    std::cerr << "step " << s << " loss " << step["loss"] << " grad_norm " << step["grad_norm"] << " "
              << w << " s replicas_equal " << r->replicas_equal() << "\n";
  }
  std::vector<double> sorted = wall;
  std::sort(sorted.begin(), sorted.end());
  if (!sorted.empty()) {
    j["step_s_median"] = sorted[sorted.size() / 2];
    j["tokens_per_s"] = batch_tokens / sorted[sorted.size() / 2];
  }
  auto fwd = run->Forward(batch);
  if (!fwd.ok()) return Fail(fwd.status(), "Forward");
  std::vector<float> logprobs;
  for (const auto& lp : fwd->logprobs()) logprobs.insert(logprobs.end(), lp.values().begin(), lp.values().end());
  j["forward_logprobs"] = logprobs;
  if (!absl::GetFlag(FLAGS_export_dir).empty()) {
    v1::ExportAdapterRequest req;
    req.set_run_id(run->run_id());
    req.set_path(absl::GetFlag(FLAGS_export_dir));
    auto exported = client->get()->ExportAdapter(req);
    if (!exported.ok()) return Fail(exported.status(), "ExportAdapter");
    j["adapter_dir"] = req.path();
  }
  std::ofstream(absl::GetFlag(FLAGS_out)) << j.dump() << "\n";
  return 0;
}

}  // namespace lorastep

int main(int argc, char** argv) { return lorastep::Main(argc, argv); }
