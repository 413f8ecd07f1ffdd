// lorastep: command-line client of the Trainer API, on absl flags.
//   lorastep [--address 127.0.0.1:50051] [--json] COMMAND [flags]     lorastep --help
// Every API call is a command; unknown flags, and flags that do not apply to the command,
// are errors. Optional API fields are sent only when their flag is given, so the API's own
// defaults apply (docs/API.md). --json prints the response as JSON at full precision.
#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "clients/cpp/trainer_client.h"
#include "nlohmann/json.hpp"

// Numbers are strings so that "not given" differs from any value: the API's default applies.
ABSL_FLAG(std::string, address, "127.0.0.1:50051", "coordinator address");
ABSL_FLAG(std::string, api_key, "", "API key for a coordinator with --api_keys_file (default: $LORASTEP_API_KEY)");
ABSL_FLAG(std::string, tls_ca_file, "", "CA certificate (PEM) of a coordinator serving TLS; default: plaintext");
ABSL_FLAG(bool, json, false, "print responses as JSON (full precision) instead of tables");
ABSL_FLAG(std::string, run, "", "run id");
ABSL_FLAG(std::string, run_id, "", "create: the new run's id (default: assigned)");
ABSL_FLAG(std::string, rank, "", "create: LoRA rank (default 32; 0 = full fine-tuning)");
ABSL_FLAG(std::string, alpha, "", "create: LoRA alpha (default 32)");
ABSL_FLAG(std::string, dropout, "", "create: LoRA dropout (default 0)");
ABSL_FLAG(std::string, target_modules, "", "create: comma-separated module names (default: all linear layers)");
ABSL_FLAG(std::string, seed, "", "create: adapter initialization seed; sample: sampling seed (default 0)");
ABSL_FLAG(std::string, train_attn, "", "create: true|false, LoRA on attention (Tinker's switch; with any switch given, "
          "unset ones are true and --target_modules must be empty)");
ABSL_FLAG(std::string, train_mlp, "", "create: true|false, LoRA on the MLP (a MoE layer's experts)");
ABSL_FLAG(std::string, train_unembed, "", "create: true|false, LoRA on the LM head (lm_head)");
ABSL_FLAG(std::string, init_from, "", "create: a PEFT adapter folder or a saved state (path or lorastep:// reference)");
ABSL_FLAG(bool, init_with_optimizer, false, "create: with --init_from a saved state, also its optimizer state");
ABSL_FLAG(std::string, data, "", "train, forward, forward-backward: JSONL file, one datum per line (Tinker fields)");
ABSL_FLAG(std::string, batch, "", "train: datums per TrainStep (default 64)");
ABSL_FLAG(std::string, loss, "", "loss_fn: cross_entropy (API default) | importance_sampling | ppo | cispo | dro");
ABSL_FLAG(std::string, normalization, "", "loss normalization: token (API default) | sequence | sum");
ABSL_FLAG(std::string, lr, "", "AdamW learning rate (API default 1e-5)");
ABSL_FLAG(std::string, weight_decay, "", "AdamW decoupled weight decay (API default 0)");
ABSL_FLAG(std::string, max_grad_norm, "", "gradient clipping norm (API default 0 = off)");
ABSL_FLAG(std::string, max_tokens_per_microbatch, "", "train: padded tokens per micro-batch (default: the server's)");
ABSL_FLAG(std::string, since, "", "metrics, watch, plot: first step (default 0)");
ABSL_FLAG(std::string, count, "", "watch: stop after N records (default: follow)");
ABSL_FLAG(std::string, names, "", "metrics, watch, train, top: comma-separated metric names for the table");
ABSL_FLAG(std::string, path, "", "save, load, export: folder or lorastep://<run>/<name> reference");
ABSL_FLAG(std::string, name, "", "delete-checkpoint: checkpoint name");
ABSL_FLAG(std::string, interval, "", "top: seconds between refreshes (default 2)");
ABSL_FLAG(std::string, iterations, "", "top: refreshes before exiting (default: until interrupted)");
ABSL_FLAG(std::string, out, "", "plot: PNG file to write (default <run>.png); needs gnuplot");
ABSL_FLAG(std::string, prompts, "", "sample: prompts as token ids, ids comma-separated, prompts ';'-separated");
ABSL_FLAG(std::string, num_samples, "", "sample: completions per prompt (default 1)");
ABSL_FLAG(std::string, max_tokens, "", "sample: tokens per completion (default 16)");
ABSL_FLAG(std::string, temperature, "", "sample: 0 = greedy (default 1)");
ABSL_FLAG(std::string, top_k, "", "sample: keep the k most likely tokens (default 0 = off)");
ABSL_FLAG(std::string, top_p, "", "sample: nucleus mass in (0, 1] (default 1)");
ABSL_FLAG(std::string, min_p, "", "sample: keep tokens at least this share of the most likely one (default 0)");
ABSL_FLAG(bool, base_model, false, "sample: the base model instead of the run's adapter");

namespace lorastep {
namespace {

constexpr char kUsage[] =
    "lorastep [--address A] [--json] COMMAND [flags]\n"
    "commands:\n"
    "  runs                                   list runs\n"
    "  get --run R                            one run\n"
    "  create [--rank --alpha --dropout --target_modules | --train_attn --train_mlp --train_unembed\n"
    "          --seed --run_id --init_from [--init_with_optimizer]]\n"
    "  delete --run R                         delete a run and its state\n"
    "  train --run R --data F.jsonl [--batch 64 --loss --normalization --lr --weight_decay\n"
    "        --max_grad_norm --max_tokens_per_microbatch]   one TrainStep per --batch lines\n"
    "  forward --run R --data F.jsonl         log-probs, no gradient\n"
    "  forward-backward --run R --data F.jsonl [--loss --normalization]   accumulate gradients\n"
    "  optim-step --run R [--lr --weight_decay --max_grad_norm]           apply them\n"
    "  metrics --run R [--since --names]      step history\n"
    "  watch --run R [--since --count --names]   follow new steps\n"
    "  save|load|export --run R --path P      state and PEFT adapter\n"
    "  checkpoints --run R / delete-checkpoint --run R --name N   the state store\n"
    "  top [--interval 2 --iterations N --names]   live table of runs: their last step and their sampling\n"
    "  plot --run R [--out R.png --since]     loss, reward, KL, grad norm, tokens/s against step\n"
    "  sample --run R --prompts '1,2,3;4,5' [--num_samples --max_tokens --temperature --top_k --top_p --min_p\n"
    "         --seed --base_model]           completions from the run's adapter (JSON)\n";

// The flags each command reads (besides --address and --json).
const std::map<std::string, std::set<std::string>>& CommandFlags() {
  static const auto* m = new std::map<std::string, std::set<std::string>>{
      {"runs", {}},
      {"get", {"run"}},
      {"create", {"run_id", "rank", "alpha", "dropout", "target_modules", "train_attn", "train_mlp", "train_unembed",
                  "seed", "init_from", "init_with_optimizer"}},
      {"delete", {"run"}},
      {"train", {"run", "data", "batch", "loss", "normalization", "lr", "weight_decay", "max_grad_norm",
                 "max_tokens_per_microbatch", "names"}},
      {"forward", {"run", "data"}},
      {"forward-backward", {"run", "data", "loss", "normalization"}},
      {"optim-step", {"run", "lr", "weight_decay", "max_grad_norm", "names"}},
      {"metrics", {"run", "since", "names"}},
      {"watch", {"run", "since", "count", "names"}},
      {"save", {"run", "path"}},
      {"load", {"run", "path"}},
      {"export", {"run", "path"}},
      {"checkpoints", {"run"}},
      {"delete-checkpoint", {"run", "name"}},
      {"top", {"interval", "iterations", "names"}},
      {"plot", {"run", "out", "since"}},
      {"sample", {"run", "prompts", "num_samples", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                  "base_model"}},
  };
  return *m;
}

// Which command-specific flags were given (string flags: non-empty; bools: true).
std::map<std::string, bool> GivenFlags() {
  return {{"run", !absl::GetFlag(FLAGS_run).empty()},
          {"run_id", !absl::GetFlag(FLAGS_run_id).empty()},
          {"rank", !absl::GetFlag(FLAGS_rank).empty()},
          {"alpha", !absl::GetFlag(FLAGS_alpha).empty()},
          {"dropout", !absl::GetFlag(FLAGS_dropout).empty()},
          {"target_modules", !absl::GetFlag(FLAGS_target_modules).empty()},
          {"train_attn", !absl::GetFlag(FLAGS_train_attn).empty()},
          {"train_mlp", !absl::GetFlag(FLAGS_train_mlp).empty()},
          {"train_unembed", !absl::GetFlag(FLAGS_train_unembed).empty()},
          {"seed", !absl::GetFlag(FLAGS_seed).empty()},
          {"init_from", !absl::GetFlag(FLAGS_init_from).empty()},
          {"init_with_optimizer", absl::GetFlag(FLAGS_init_with_optimizer)},
          {"data", !absl::GetFlag(FLAGS_data).empty()},
          {"batch", !absl::GetFlag(FLAGS_batch).empty()},
          {"loss", !absl::GetFlag(FLAGS_loss).empty()},
          {"normalization", !absl::GetFlag(FLAGS_normalization).empty()},
          {"lr", !absl::GetFlag(FLAGS_lr).empty()},
          {"weight_decay", !absl::GetFlag(FLAGS_weight_decay).empty()},
          {"max_grad_norm", !absl::GetFlag(FLAGS_max_grad_norm).empty()},
          {"max_tokens_per_microbatch", !absl::GetFlag(FLAGS_max_tokens_per_microbatch).empty()},
          {"since", !absl::GetFlag(FLAGS_since).empty()},
          {"count", !absl::GetFlag(FLAGS_count).empty()},
          {"names", !absl::GetFlag(FLAGS_names).empty()},
          {"path", !absl::GetFlag(FLAGS_path).empty()},
          {"name", !absl::GetFlag(FLAGS_name).empty()},
          {"interval", !absl::GetFlag(FLAGS_interval).empty()},
          {"iterations", !absl::GetFlag(FLAGS_iterations).empty()},
          {"out", !absl::GetFlag(FLAGS_out).empty()},
          {"prompts", !absl::GetFlag(FLAGS_prompts).empty()},
          {"num_samples", !absl::GetFlag(FLAGS_num_samples).empty()},
          {"max_tokens", !absl::GetFlag(FLAGS_max_tokens).empty()},
          {"temperature", !absl::GetFlag(FLAGS_temperature).empty()},
          {"top_k", !absl::GetFlag(FLAGS_top_k).empty()},
          {"top_p", !absl::GetFlag(FLAGS_top_p).empty()},
          {"min_p", !absl::GetFlag(FLAGS_min_p).empty()},
          {"base_model", absl::GetFlag(FLAGS_base_model)}};
}

int Fail(const absl::Status& s) {
  std::cerr << "lorastep: " << s << "\n";
  return 1;
}

int Usage(const std::string& what) {
  std::cerr << "lorastep: " << what << "\nusage: " << kUsage;
  return 2;
}

// A numeric flag's value; `*given` is false when it was not given.
template <typename T>
absl::StatusOr<T> Number(const std::string& flag, const std::string& text, T fallback) {
  if (text.empty()) return fallback;
  T v{};
  bool ok;
  if constexpr (std::is_floating_point_v<T>) {
    ok = absl::SimpleAtod(text, &v);
  } else {
    ok = absl::SimpleAtoi(text, &v);
  }
  if (!ok) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", text, "' is not a number"));
  return v;
}

// A true|false flag: nullopt when not given.
absl::StatusOr<std::optional<bool>> Switch(const std::string& flag, const std::string& text) {
  if (text.empty()) return std::optional<bool>();
  if (text == "true" || text == "false") return std::optional<bool>(text == "true");
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", text, "' is not true or false"));
}

#define LORASTEP_CLI_ASSIGN(lhs, expr) \
  auto lhs##_or = (expr);              \
  if (!lhs##_or.ok()) return Fail(lhs##_or.status()); \
  auto lhs = *lhs##_or

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

absl::StatusOr<std::vector<v1::Datum>> ReadData(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--data: cannot open '", path, "'"));
  std::vector<v1::Datum> out;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": not JSON"));
    auto d = DatumFromJson(j, line_no);
    if (!d.ok()) return d.status();
    out.push_back(*std::move(d));
  }
  return out;
}

absl::StatusOr<v1::LossConfig> LossFromFlags() {
  v1::LossConfig loss;
  loss.set_loss_fn(absl::GetFlag(FLAGS_loss));
  loss.set_normalization(absl::GetFlag(FLAGS_normalization));
  return loss;
}

absl::StatusOr<v1::AdamWParams> AdamWFromFlags() {
  v1::AdamWParams a;
  for (auto [flag, text, set] : {std::tuple<const char*, std::string, void (v1::AdamWParams::*)(double)>{
                                     "lr", absl::GetFlag(FLAGS_lr), &v1::AdamWParams::set_lr},
                                 {"weight_decay", absl::GetFlag(FLAGS_weight_decay), &v1::AdamWParams::set_weight_decay},
                                 {"max_grad_norm", absl::GetFlag(FLAGS_max_grad_norm), &v1::AdamWParams::set_max_grad_norm}}) {
    if (text.empty()) continue;  // the API's default
    auto v = Number<double>(flag, text, 0.0);
    if (!v.ok()) return v.status();
    (a.*set)(*v);
  }
  return a;
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string Cell(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.10g", v);
  return buf;
}

void PrintTable(const std::vector<v1::StepRecord>& records, const std::vector<std::string>& names,
                bool header = true) {
  if (absl::GetFlag(FLAGS_json)) {
    for (const auto& r : records) std::cout << Json(r) << "\n";
    std::cout.flush();
    return;
  }
  if (header) {
    std::printf("%5s %8s", "step", "version");
    for (const auto& n : names) std::printf(" %18s", n.c_str());
    std::printf("\n");
  }
  for (const auto& r : records) {
    std::printf("%5lld %8lld", static_cast<long long>(r.step()), static_cast<long long>(r.learner_version()));
    for (const auto& n : names) {
      auto it = r.metrics().find(n);
      std::printf(" %18s", it == r.metrics().end() ? "-" : Cell(it->second).c_str());
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

std::vector<std::string> Names() {
  const std::string n = absl::GetFlag(FLAGS_names);
  if (!n.empty()) return absl::StrSplit(n, ',', absl::SkipEmpty());
  return {"loss:sum", "pg_clipfrac:mean", "ppo_kl:mean", "entropy:mean", "grad_norm:sum", "tokens_per_s:sum",
          "time_step_s:sum"};
}

v1::StepRecord RecordOf(const v1::StepResponse& s) {
  v1::StepRecord r;
  r.set_step(s.step());
  r.set_learner_version(s.learner_version());
  *r.mutable_metrics() = s.metrics();
  return r;
}

// A small text chart of one series: `rows` lines, one column per step (resampled).
void Sketch(const std::string& title, const std::vector<double>& xs, const std::vector<double>& ys) {
  constexpr int kRows = 8, kCols = 60;
  if (ys.empty()) return;
  const auto [lo_it, hi_it] = std::minmax_element(ys.begin(), ys.end());
  double lo = *lo_it, hi = *hi_it;
  if (hi <= lo) {  // a constant series: centred in a band around its value
    const double pad = std::max(1e-12, 0.5 * std::abs(lo));
    lo -= pad;
    hi += pad;
  }
  const double span = hi - lo;
  const int cols = std::min<int>(kCols, static_cast<int>(ys.size()));
  std::vector<std::string> grid(kRows, std::string(cols, ' '));
  for (int c = 0; c < cols; ++c) {
    const size_t i = cols == 1 ? 0 : static_cast<size_t>(std::lround(double(c) * (ys.size() - 1) / (cols - 1)));
    const int row = static_cast<int>(std::lround((ys[i] - lo) / span * (kRows - 1)));
    grid[kRows - 1 - row][c] = '*';
  }
  std::printf("%s  (steps %g-%g)\n", title.c_str(), xs.front(), xs.back());
  for (int r = 0; r < kRows; ++r) {
    const double label = hi - span * r / (kRows - 1);
    std::printf("%12.5g |%s\n", label, grid[r].c_str());
  }
}

int Plot(TrainerClient& c, const std::string& run_id, int64_t since) {
  v1::GetStepMetricsRequest req;
  req.set_run_id(run_id);
  req.set_since_step(since);
  auto r = c.GetStepMetrics(req);
  if (!r.ok()) return Fail(r.status());
  if (r->steps_size() == 0) return Fail(absl::FailedPreconditionError(absl::StrCat("run '", run_id, "' has no steps yet")));
  // The trainer's figures, and the orchestrator's where it sent them (client_metrics).
  const std::vector<std::pair<std::string, std::string>> series = {
      {"loss:sum", "loss"}, {"client:reward", "reward"}, {"client:good_logprob", "good-token log-prob"},
      {"client:mismatch_max", "train/sample log-prob mismatch (max)"}, {"ppo_kl:mean", "KL (ppo_kl)"},
      {"grad_norm:sum", "grad norm"}, {"tokens_per_s:sum", "tokens/s"}};
  std::vector<std::pair<std::string, std::string>> present;
  for (const auto& s : series) {
    if (r->steps(0).metrics().count(s.first)) present.push_back(s);
  }
  const std::string dat = absl::StrCat("/tmp/lorastep-plot-", getpid(), ".dat");
  {
    std::ofstream out(dat);
    for (const auto& rec : r->steps()) {
      out << rec.step();
      for (const auto& [key, title] : present) {
        auto it = rec.metrics().find(key);
        out << " " << (it == rec.metrics().end() ? std::string("NaN") : Cell(it->second));
      }
      out << "\n";
    }
  }
  for (size_t k = 0; k < present.size(); ++k) {
    std::vector<double> xs, ys;
    for (const auto& rec : r->steps()) {
      auto it = rec.metrics().find(present[k].first);
      if (it == rec.metrics().end()) continue;
      xs.push_back(static_cast<double>(rec.step()));
      ys.push_back(it->second);
    }
    Sketch(present[k].second, xs, ys);
  }
  const std::string png = absl::GetFlag(FLAGS_out).empty() ? run_id + ".png" : absl::GetFlag(FLAGS_out);
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) {
    std::remove(dat.c_str());
    std::cout << "no gnuplot on this machine (apt-get install gnuplot-nox): no PNG written\n";
    return 0;
  }
  const std::string gp = dat + ".gp";
  {
    std::ofstream g(gp);
    const int n = static_cast<int>(present.size());
    const int cols = 2, rows = (n + 1) / 2;
    g << "set terminal pngcairo size 1200," << 320 * rows << " noenhanced\n"
      << "set output '" << png << "'\n"
      << "set multiplot layout " << rows << "," << cols << " title 'lorastep run " << run_id << "'\n"
      << "set grid\nset xlabel 'step'\nunset key\n";
    for (int k = 0; k < n; ++k) {
      g << "set title '" << present[k].second << "'\nplot '" << dat << "' using 1:" << (k + 2)
        << " with linespoints pt 7 ps 0.6\n";
    }
    g << "unset multiplot\n";
  }
  const int rc = std::system(absl::StrCat("gnuplot '", gp, "' 2>&1").c_str());
  std::remove(dat.c_str());
  std::remove(gp.c_str());
  if (rc != 0) return Fail(absl::InternalError("gnuplot failed"));
  std::cout << "plot of " << r->steps_size() << " steps written to " << png << "\n";
  return 0;
}

int Top(TrainerClient& c) {
  LORASTEP_CLI_ASSIGN(interval, Number<double>("interval", absl::GetFlag(FLAGS_interval), 2.0));
  LORASTEP_CLI_ASSIGN(iterations, Number<int64_t>("iterations", absl::GetFlag(FLAGS_iterations), 0));
  const std::vector<std::string> names = absl::GetFlag(FLAGS_names).empty()
      ? std::vector<std::string>{"loss:sum", "grad_norm:sum", "tokens_per_s:sum", "time_step_s:sum"}
      : Names();
  const bool tty = isatty(STDOUT_FILENO);
  for (int64_t i = 0; iterations == 0 || i < iterations; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    auto runs = c.ListRuns();
    if (!runs.ok()) return Fail(runs.status());
    if (tty) std::printf("\033[H\033[2J");
    std::printf("%-14s %8s %6s %-9s %8s %10s %12s", "run", "version", "step", "status", "samples", "sampled",
                "sample_tok/s");
    for (const auto& n : names) std::printf(" %16s", n.c_str());
    std::printf("\n");
    for (const auto& run : runs->runs()) {
      std::printf("%-14s %8lld %6lld %-9s", run.run_id().c_str(), static_cast<long long>(run.learner_version()),
                  static_cast<long long>(run.last_step()), run.diverged().empty() ? "active" : "diverged");
      // Sampling beside training: the run's Sample calls, tokens sampled, the latest call's rate.
      const v1::RunSampling& sampling = run.sampling();
      std::printf(" %8lld %10lld %12s", static_cast<long long>(sampling.calls()),
                  static_cast<long long>(sampling.sampled_tokens()),
                  sampling.calls() > 0 ? Cell(sampling.last_tokens_per_s()).c_str() : "-");
      v1::GetStepMetricsRequest req;
      req.set_run_id(run.run_id());
      req.set_since_step(std::max<int64_t>(0, run.last_step()));
      auto m = c.GetStepMetrics(req);
      const v1::StepRecord* last = m.ok() && m->steps_size() > 0 ? &m->steps(m->steps_size() - 1) : nullptr;
      for (const auto& n : names) {
        auto it = last ? last->metrics().find(n) : google::protobuf::Map<std::string, double>::const_iterator();
        std::printf(" %16s", last && it != last->metrics().end() ? Cell(it->second).c_str() : "-");
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }
  return 0;
}

// --help (exit 0): the commands, then this binary's flags with their help and defaults.
int Help() {
  std::cout << "usage: " << kUsage << "flags:\n";
  std::map<std::string, const absl::CommandLineFlag*> mine;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "lorastep_cli")) mine[std::string(name)] = flag;
  }
  for (const auto& [name, flag] : mine) {
    const std::string def = flag->DefaultValue();
    std::cout << "  --" << name << "  " << flag->Help() << (def.empty() ? "" : absl::StrCat(" [", def, "]")) << "\n";
  }
  return 0;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "-help") return Help();
  }
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);  // unknown flags: error, exit
  if (positional.size() != 2) {
    return Usage(positional.size() < 2 ? "no command" : absl::StrCat("one command expected, got ",
                                                                    positional.size() - 1));
  }
  const std::string command = positional[1];
  auto allowed = CommandFlags().find(command);
  if (allowed == CommandFlags().end()) return Usage(absl::StrCat("unknown command '", command, "'"));
  for (const auto& [flag, given] : GivenFlags()) {
    if (given && !allowed->second.count(flag)) {
      return Usage(absl::StrCat("--", flag, " does not apply to '", command, "'"));
    }
  }
  if (allowed->second.count("run") && command != "top" && absl::GetFlag(FLAGS_run).empty()) {
    return Usage(absl::StrCat("--run is required for ", command));
  }
  std::string api_key = absl::GetFlag(FLAGS_api_key);
  if (api_key.empty() && std::getenv("LORASTEP_API_KEY") != nullptr) api_key = std::getenv("LORASTEP_API_KEY");
  std::string ca_pem;
  if (!absl::GetFlag(FLAGS_tls_ca_file).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_tls_ca_file));
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("--tls_ca_file: cannot read '", absl::GetFlag(FLAGS_tls_ca_file), "'")));
    ca_pem.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto client = TrainerClient::Connect(absl::GetFlag(FLAGS_address), 10, api_key, ca_pem);
  if (!client.ok()) return Fail(client.status());
  TrainerClient& c = **client;
  const bool json = absl::GetFlag(FLAGS_json);
  const std::string run_id = absl::GetFlag(FLAGS_run);

  if (command == "runs") {
    auto r = c.ListRuns();
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << Json(*r) << "\n";
      return 0;
    }
    std::printf("%-14s %-12s %6s %8s %9s %8s %9s %-9s %s\n", "run_id", "owner", "rank", "version", "autosaved",
                "next_seq", "last_step", "status", "base_model");
    for (const auto& run : r->runs()) {
      // autosaved: where a restart would resume the run ("-": no durable autosave, or no journal)
      const std::string autosaved =
          run.has_autosaved_learner_version() ? std::to_string(run.autosaved_learner_version()) : "-";
      std::printf("%-14s %-12s %6lld %8lld %9s %8lld %9lld %-9s %s\n", run.run_id().c_str(),
                  run.owner().empty() ? "-" : run.owner().c_str(),
                  static_cast<long long>(run.lora().rank()), static_cast<long long>(run.learner_version()),
                  autosaved.c_str(), static_cast<long long>(run.next_sequence_id()), static_cast<long long>(run.last_step()),
                  run.diverged().empty() ? "active" : "diverged", run.base_model().c_str());
    }
    return 0;
  }
  if (command == "get") {
    auto r = c.GetRun(run_id);
    if (!r.ok()) return Fail(r.status());
    std::cout << Json(*r) << "\n";
    return 0;
  }
  if (command == "create") {
    v1::CreateRunRequest req;
    req.set_request_id(NewRequestId());
    req.set_run_id(absl::GetFlag(FLAGS_run_id));
    v1::LoraConfig& lora = *req.mutable_lora();
    LORASTEP_CLI_ASSIGN(rank, Number<int64_t>("rank", absl::GetFlag(FLAGS_rank), 32));
    LORASTEP_CLI_ASSIGN(alpha, Number<double>("alpha", absl::GetFlag(FLAGS_alpha), 32.0));
    LORASTEP_CLI_ASSIGN(dropout, Number<double>("dropout", absl::GetFlag(FLAGS_dropout), 0.0));
    LORASTEP_CLI_ASSIGN(seed, Number<uint64_t>("seed", absl::GetFlag(FLAGS_seed), 0));
    lora.set_rank(rank);
    lora.set_alpha(alpha);
    lora.set_dropout(dropout);
    for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_target_modules), ',', absl::SkipEmpty())) {
      lora.add_target_modules(std::string(m));
    }
    LORASTEP_CLI_ASSIGN(train_attn, Switch("train_attn", absl::GetFlag(FLAGS_train_attn)));
    LORASTEP_CLI_ASSIGN(train_mlp, Switch("train_mlp", absl::GetFlag(FLAGS_train_mlp)));
    LORASTEP_CLI_ASSIGN(train_unembed, Switch("train_unembed", absl::GetFlag(FLAGS_train_unembed)));
    if (train_attn) lora.set_train_attn(*train_attn);
    if (train_mlp) lora.set_train_mlp(*train_mlp);
    if (train_unembed) lora.set_train_unembed(*train_unembed);
    req.set_seed(seed);
    req.set_init_from(absl::GetFlag(FLAGS_init_from));
    req.set_init_with_optimizer(absl::GetFlag(FLAGS_init_with_optimizer));
    auto r = c.CreateRun(req);
    if (!r.ok()) return Fail(r.status());
    std::cout << (json ? Json(*r) : r->run_id()) << "\n";
    return 0;
  }
  if (command == "delete") {
    absl::Status s = c.DeleteRun(run_id);
    if (!s.ok()) return Fail(s);
    std::cout << "deleted " << run_id << "\n";
    return 0;
  }
  if (command == "train" || command == "forward" || command == "forward-backward") {
    if (absl::GetFlag(FLAGS_data).empty()) return Usage(absl::StrCat("--data is required for ", command));
    LORASTEP_CLI_ASSIGN(data, ReadData(absl::GetFlag(FLAGS_data)));
    auto session = RunSession::Attach(&c, run_id);
    if (!session.ok()) return Fail(session.status());
    LORASTEP_CLI_ASSIGN(loss, LossFromFlags());
    if (command == "forward" || command == "forward-backward") {
      auto r = command == "forward" ? session->Forward(data) : session->ForwardBackward(data, loss);
      if (!r.ok()) return Fail(r.status());
      std::cout << Json(*r) << "\n";
      return 0;
    }
    LORASTEP_CLI_ASSIGN(adamw, AdamWFromFlags());
    LORASTEP_CLI_ASSIGN(batch_size, Number<int64_t>("batch", absl::GetFlag(FLAGS_batch), 64));
    LORASTEP_CLI_ASSIGN(max_tokens, Number<int64_t>("max_tokens_per_microbatch",
                                                     absl::GetFlag(FLAGS_max_tokens_per_microbatch), 0));
    if (batch_size <= 0) return Usage("--batch must be positive");
    const size_t steps = (data.size() + batch_size - 1) / batch_size;
    for (size_t s = 0; s < steps; ++s) {
      const size_t begin = s * batch_size, end = std::min(data.size(), begin + batch_size);
      std::cerr << "step " << s + 1 << "/" << steps << ": " << end - begin << " datums\n";  // progress
      auto step = session->TrainStep({data.begin() + begin, data.begin() + end}, loss, adamw, max_tokens);
      if (!step.ok()) return Fail(step.status());
      if (json) {
        std::cout << Json(*step) << "\n";
      } else {
        PrintTable({RecordOf(*step)}, Names(), /*header=*/s == 0);
      }
    }
    return 0;
  }
  if (command == "optim-step") {
    LORASTEP_CLI_ASSIGN(adamw, AdamWFromFlags());
    auto session = RunSession::Attach(&c, run_id);
    if (!session.ok()) return Fail(session.status());
    auto r = session->OptimStep(adamw);
    if (!r.ok()) return Fail(r.status());
    if (json) {
      std::cout << Json(*r) << "\n";
    } else {
      PrintTable({RecordOf(*r)}, Names());
    }
    return 0;
  }
  LORASTEP_CLI_ASSIGN(since, Number<int64_t>("since", absl::GetFlag(FLAGS_since), 0));
  if (command == "metrics") {
    v1::GetStepMetricsRequest req;
    req.set_run_id(run_id);
    req.set_since_step(since);
    auto r = c.GetStepMetrics(req);
    if (!r.ok()) return Fail(r.status());
    PrintTable({r->steps().begin(), r->steps().end()}, Names());
    return 0;
  }
  if (command == "watch") {
    LORASTEP_CLI_ASSIGN(count, Number<int64_t>("count", absl::GetFlag(FLAGS_count), 0));
    v1::WatchMetricsRequest req;
    req.set_run_id(run_id);
    req.set_since_step(since);
    int64_t seen = 0;
    auto s = c.WatchMetrics(req, [&](const v1::StepRecord& r) {
      PrintTable({r}, Names(), /*header=*/seen == 0);
      return count == 0 || ++seen < count;
    });
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "save" || command == "load" || command == "export") {
    const std::string path = absl::GetFlag(FLAGS_path);
    if (path.empty()) return Usage(absl::StrCat("--path is required for ", command));
    if (command == "save") {
      v1::SaveStateRequest req;
      req.set_run_id(run_id);
      req.set_path(path);
      auto r = c.SaveState(req);
      if (!r.ok()) return Fail(r.status());
      std::cout << (json ? Json(*r) : absl::StrCat("saved learner version ", r->learner_version(), " to ", r->path()))
                << "\n";
    } else if (command == "load") {
      auto session = RunSession::Attach(&c, run_id);
      if (!session.ok()) return Fail(session.status());
      auto r = session->LoadState(path);
      if (!r.ok()) return Fail(r.status());
      std::cout << (json ? Json(*r) : absl::StrCat("loaded learner version ", r->learner_version())) << "\n";
    } else {
      v1::ExportAdapterRequest req;
      req.set_run_id(run_id);
      req.set_path(path);
      auto r = c.ExportAdapter(req);
      if (!r.ok()) return Fail(r.status());
      std::cout << (json ? Json(*r) : absl::StrCat("exported ", r->path(), " sha256 ", r->adapter_sha256())) << "\n";
    }
    return 0;
  }
  if (command == "checkpoints") {
    v1::ListCheckpointsRequest req;
    req.set_run_id(run_id);
    auto r = c.ListCheckpoints(req);
    if (!r.ok()) return Fail(r.status());
    std::cout << Json(*r) << "\n";
    return 0;
  }
  if (command == "delete-checkpoint") {
    if (absl::GetFlag(FLAGS_name).empty()) return Usage("--name is required for delete-checkpoint");
    v1::DeleteCheckpointRequest req;
    req.set_run_id(run_id);
    req.set_name(absl::GetFlag(FLAGS_name));
    auto r = c.DeleteCheckpoint(req);
    if (!r.ok()) return Fail(r.status());
    std::cout << "deleted checkpoint " << req.name() << "\n";
    return 0;
  }
  if (command == "top") return Top(c);
  if (command == "sample") {
    v1::SampleRequest req;
    req.set_run_id(run_id);
    req.set_base_model(absl::GetFlag(FLAGS_base_model));
    if (absl::GetFlag(FLAGS_prompts).empty()) return Usage("--prompts is required for sample");
    for (absl::string_view prompt : absl::StrSplit(absl::GetFlag(FLAGS_prompts), ';')) {
      v1::TokenSequence* p = req.add_prompts();
      for (absl::string_view id : absl::StrSplit(prompt, ',', absl::SkipWhitespace())) {
        int64_t token = 0;
        if (!absl::SimpleAtoi(id, &token)) return Usage(absl::StrCat("--prompts: '", id, "' is not a token id"));
        p->add_tokens(token);
      }
    }
    v1::SamplingParams* params = req.mutable_params();
    LORASTEP_CLI_ASSIGN(num_samples, Number<int64_t>("num_samples", absl::GetFlag(FLAGS_num_samples), 1));
    LORASTEP_CLI_ASSIGN(max_tokens, Number<int64_t>("max_tokens", absl::GetFlag(FLAGS_max_tokens), 16));
    LORASTEP_CLI_ASSIGN(temperature, Number<double>("temperature", absl::GetFlag(FLAGS_temperature), 1.0));
    LORASTEP_CLI_ASSIGN(top_k, Number<int64_t>("top_k", absl::GetFlag(FLAGS_top_k), 0));
    LORASTEP_CLI_ASSIGN(top_p, Number<double>("top_p", absl::GetFlag(FLAGS_top_p), 1.0));
    LORASTEP_CLI_ASSIGN(min_p, Number<double>("min_p", absl::GetFlag(FLAGS_min_p), 0.0));
    LORASTEP_CLI_ASSIGN(seed, Number<uint64_t>("seed", absl::GetFlag(FLAGS_seed), 0));
    req.set_num_samples(num_samples);
    params->set_max_tokens(max_tokens);
    params->set_temperature(temperature);
    params->set_top_k(top_k);
    params->set_top_p(top_p);
    params->set_min_p(min_p);
    params->set_seed(seed);
    auto r = c.Sample(req);
    if (!r.ok()) return Fail(r.status());
    std::cout << Json(*r) << "\n";
    return 0;
  }
  return Plot(c, run_id, since);  // "plot": the last command of the table
}

}  // namespace
}  // namespace lorastep

int main(int argc, char** argv) { return lorastep::Main(argc, argv); }
