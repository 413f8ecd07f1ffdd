// lorastep: command-line client of the Trainer API.
//   lorastep [--address 127.0.0.1:50051] COMMAND [flags]
//   runs                                    list runs
//   create [--rank 32] [--alpha 32] [--dropout 0] [--seed 0] [--run_id ID]
//   train --run ID --data FILE.jsonl [--batch 64] [--loss ppo] [--lr 1e-5] [--max_grad_norm 1]
//         one TrainStep per --batch lines of JSON datums (Tinker fields)
//   metrics --run ID [--since 0] [--names loss:sum,grad_norm:sum,...]   step table
//   watch --run ID [--since 0] [--count N]   follow the metric stream
//   save|load|export --run ID --path DIR
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"
#include "rpc/server_runner.h"

namespace lorastep {
namespace {

int Fail(const absl::Status& s) {
  std::cerr << "lorastep: " << s << "\n";
  return 1;
}

absl::StatusOr<v1::Datum> DatumFromJson(const nlohmann::json& j, int line) {
  v1::Datum d;
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat("line ", line, ": not an object"));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (!it->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", k, ": not a list"));
    }
    try {
      if (k == "tokens") for (auto& v : *it) d.add_tokens(v.get<int64_t>());
      else if (k == "target_tokens") for (auto& v : *it) d.add_target_tokens(v.get<int64_t>());
      else if (k == "weights") for (auto& v : *it) d.add_weights(v.get<float>());
      else if (k == "logprobs") for (auto& v : *it) d.add_logprobs(v.get<float>());
      else if (k == "advantages") for (auto& v : *it) d.add_advantages(v.get<float>());
      else if (k == "ref_logprobs") for (auto& v : *it) d.add_ref_logprobs(v.get<float>());
      else if (k == "old_logprobs") for (auto& v : *it) d.add_old_logprobs(v.get<float>());
      else return absl::InvalidArgumentError(absl::StrCat("line ", line, ": unknown field ", k));
    } catch (const nlohmann::json::exception&) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", k, ": not numbers"));
    }
  }
  return d;
}

void PrintTable(const std::vector<v1::StepRecord>& records, const std::vector<std::string>& names,
                bool header = true) {
  if (header) {
    std::printf("%5s %8s", "step", "version");
    for (const auto& n : names) std::printf(" %16s", n.c_str());
    std::printf("\n");
  }
  for (const auto& r : records) {
    std::printf("%5lld %8lld", static_cast<long long>(r.step()),
                static_cast<long long>(r.learner_version()));
    for (const auto& n : names) {
      auto it = r.metrics().find(n);
      if (it == r.metrics().end()) {
        std::printf(" %16s", "-");
      } else {
        std::printf(" %16.6g", it->second);
      }
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: lorastep [--address A] runs|create|train|metrics|watch|save|load|export ...\n";
    return 2;
  }
  auto flags = ParseFlags(argc, argv);
  std::string command;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      if (a.find('=') == std::string::npos && i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) ++i;
      continue;
    }
    command = a;
    break;
  }
  auto flag = [&](const char* name, const std::string& def) {
    return flags.count(name) ? flags[name] : def;
  };
  auto client = TrainerClient::Connect(flag("address", "127.0.0.1:50051"), 10);
  if (!client.ok()) return Fail(client.status());
  TrainerClient& c = **client;
  const std::string run_id = flag("run", "");
  const std::vector<std::string> default_names = {
      "loss:sum", "pg_clipfrac:mean", "ppo_kl:mean", "entropy:mean", "grad_norm:sum",
      "tokens_per_s:sum", "time_step_s:sum"};
  std::vector<std::string> names = default_names;
  if (flags.count("names")) names = absl::StrSplit(flags["names"], ',', absl::SkipEmpty());

  if (command == "runs") {
    auto r = c.ListRuns();
    if (!r.ok()) return Fail(r.status());
    std::printf("%-12s %6s %8s %8s %9s %-9s %s\n", "run_id", "rank", "version", "next_seq", "last_step",
                "status", "base_model");
    for (const auto& run : r->runs()) {
      std::printf("%-12s %6lld %8lld %8lld %9lld %-9s %s\n", run.run_id().c_str(),
                  static_cast<long long>(run.lora().rank()),
                  static_cast<long long>(run.learner_version()),
                  static_cast<long long>(run.next_sequence_id()), static_cast<long long>(run.last_step()),
                  run.diverged().empty() ? "active" : "diverged", run.base_model().c_str());
    }
    return 0;
  }
  if (command == "create") {
    v1::LoraConfig lora;
    lora.set_rank(std::stoll(flag("rank", "32")));
    lora.set_alpha(std::stod(flag("alpha", "32")));
    lora.set_dropout(std::stod(flag("dropout", "0")));
    auto run = RunSession::Create(&c, lora, std::stoull(flag("seed", "0")), flag("run_id", ""));
    if (!run.ok()) return Fail(run.status());
    std::cout << run->run_id() << "\n";
    return 0;
  }
  if (run_id.empty()) {
    std::cerr << "lorastep: --run is required for " << command << "\n";
    return 2;
  }
  if (command == "train") {
    std::ifstream in(flag("data", ""));
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("--data: cannot open ", flag("data", ""))));
    auto session = RunSession::Attach(&c, run_id);
    if (!session.ok()) return Fail(session.status());
    v1::LossConfig loss;
    loss.set_loss_fn(flag("loss", "ppo"));
    v1::AdamWParams adamw;
    adamw.set_lr(std::stod(flag("lr", "1e-5")));
    adamw.set_max_grad_norm(std::stod(flag("max_grad_norm", "1")));
    const size_t batch_size = std::stoul(flag("batch", "64"));
    std::vector<v1::Datum> batch;
    int batch_count = 0;
    std::string line;
    int line_no = 0;
    auto flush = [&]() -> absl::Status {
      if (batch.empty()) return absl::OkStatus();
      auto step = session->TrainStep(batch, loss, adamw);
      if (!step.ok()) return step.status();
      v1::StepRecord r;
      r.set_step(step->step());
      r.set_learner_version(step->learner_version());
      *r.mutable_metrics() = step->metrics();
      PrintTable({r}, names, /*header=*/r.step() == 0 || batch_count++ == 0);
      batch.clear();
      return absl::OkStatus();
    };
    while (std::getline(in, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded()) return Fail(absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": not JSON")));
      auto d = DatumFromJson(j, line_no);
      if (!d.ok()) return Fail(d.status());
      batch.push_back(*d);
      if (batch.size() == batch_size) {
        if (auto s = flush(); !s.ok()) return Fail(s);
      }
    }
    if (auto s = flush(); !s.ok()) return Fail(s);
    return 0;
  }
  if (command == "metrics") {
    v1::GetStepMetricsRequest req;
    req.set_run_id(run_id);
    req.set_since_step(std::stoll(flag("since", "0")));
    auto r = c.GetStepMetrics(req);
    if (!r.ok()) return Fail(r.status());
    PrintTable({r->steps().begin(), r->steps().end()}, names);
    return 0;
  }
  if (command == "watch") {
    v1::WatchMetricsRequest req;
    req.set_run_id(run_id);
    req.set_since_step(std::stoll(flag("since", "0")));
    const long long count = std::stoll(flag("count", "0"));
    long long seen = 0;
    auto s = c.WatchMetrics(req, [&](const v1::StepRecord& r) {
      PrintTable({r}, names, /*header=*/seen == 0);
      return count == 0 || ++seen < count;
    });
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "save" || command == "load" || command == "export") {
    const std::string path = flag("path", "");
    if (command == "save") {
      v1::SaveStateRequest req;
      req.set_run_id(run_id);
      req.set_path(path);
      auto r = c.SaveState(req);
      if (!r.ok()) return Fail(r.status());
      std::cout << "saved learner version " << r->learner_version() << " to " << r->path() << "\n";
    } else if (command == "load") {
      auto session = RunSession::Attach(&c, run_id);
      if (!session.ok()) return Fail(session.status());
      auto r = session->LoadState(path);
      if (!r.ok()) return Fail(r.status());
      std::cout << "loaded learner version " << r->learner_version() << "\n";
    } else {
      v1::ExportAdapterRequest req;
      req.set_run_id(run_id);
      req.set_path(path);
      auto r = c.ExportAdapter(req);
      if (!r.ok()) return Fail(r.status());
      std::cout << "exported " << r->path() << " sha256 " << r->adapter_sha256() << "\n";
    }
    return 0;
  }
  std::cerr << "lorastep: unknown command '" << command << "'\n";
  return 2;
}

}  // namespace
}  // namespace lorastep

int main(int argc, char** argv) { return lorastep::Main(argc, argv); }
