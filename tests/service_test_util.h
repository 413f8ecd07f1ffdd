// Helpers shared by the service tests (service_test.cc) and the process tests
// (process_test.cc): small RL batches, the tiny model on disk, a coordinator with its local
// worker, and waiting for a run's autosave.
#ifndef LORASTEP_TESTS_SERVICE_TEST_UTIL_H_
#define LORASTEP_TESTS_SERVICE_TEST_UTIL_H_

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "clients/cpp/trainer_client.h"
#include "lib/model/model_weights.h"
#include "server/child_server.h"
#include "tests/process_runner.h"
#include "tests/proto_test_util.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace service_testing {

using ::lorastep::testing::ProcessResult;
using ::lorastep::testing::RunProcesses;
using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

// Workers started apart from a coordinator hold its cluster secret (see test_util.h).
inline const bool kClusterSecretShared = (testing::ShareClusterSecretWithServers(), true);


inline std::string Binary(const std::string& bazel_path) { return lorastep::testing::TestBinary(bazel_path); }

inline v1::Datum MakeDatum(int i, int step, int n, int64_t vocab) {
  return lorastep::testing::RlDatum(i, step, n, vocab);
}

inline std::vector<v1::Datum> Batch(int step, int n = 8) {
  std::vector<v1::Datum> out;
  for (int i = 0; i < 4; ++i) out.push_back(MakeDatum(i, step, n + (i % 2) * (step % 3), 96));
  return out;
}

// Moves a request's datums into its packed_datums; false when they cannot be packed.
template <typename Req>
bool ToPacked(Req* req) {
  std::vector<v1::Datum> datums(req->datums().begin(), req->datums().end());
  if (!PackDatums(datums, req->mutable_packed_datums())) return false;
  req->clear_datums();
  return true;
}

inline v1::LossConfig Ppo() {
  v1::LossConfig l;
  l.set_loss_fn("ppo");
  return l;
}

inline v1::AdamWParams Adam() {
  v1::AdamWParams a;
  a.set_lr(1e-2);
  a.set_beta2(0.98);
  a.set_weight_decay(0.1);
  a.set_max_grad_norm(1.0);
  return a;
}

inline v1::LoraConfig Lora(double dropout = 0.0) {
  v1::LoraConfig l;
  l.set_rank(4);
  l.set_alpha(8);
  l.set_dropout(dropout);
  return l;
}

// ScratchDir(name), with a fresh model of `preset` (seed 1) written to its "model" folder.
inline absl::StatusOr<std::string> TinyModelDir(const std::string& name, const std::string& preset = "tiny") {
  const std::string dir = ScratchDir(name);
  const ModelConfig c = ModelConfigPreset(preset).value();
  if (absl::Status saved = SaveModel(dir + "/model", c, RandomModelWeights(c, 1)); !saved.ok()) return saved;
  return dir;
}

// A coordinator (and its local worker) serving a fresh model of `preset` (the tiny one by
// default) under ScratchDir(name), with `extra` flags.
inline absl::StatusOr<ChildServer> StartTinyCoordinator(const std::string& name,
                                                 const std::vector<std::string>& extra = {},
                                                 const std::string& preset = "tiny") {
  absl::StatusOr<std::string> made = TinyModelDir(name, preset);
  if (!made.ok()) return made.status();
  const std::string& dir = *made;
  std::vector<std::string> args = {"--model", dir + "/model", "--worker_binary", Binary("worker/lorastep_worker")};
  args.insert(args.end(), extra.begin(), extra.end());
  return ChildServer::Start(Binary("server/lorastep_coordinator"), args, 120);
}

// Background autosaves become durable shortly after the step's response: a test that kills a
// process and expects the run back at `version` waits for that first.
inline void WaitUntilAutosaved(TrainerClient* client, const std::string& run_id, int64_t version) {
  absl::StatusOr<v1::Run> run = absl::UnknownError("not asked");
  if (testing::WaitFor(
          [&] {
            run = client->GetRun(run_id);
            return run.ok() && run->has_autosaved_learner_version() && run->autosaved_learner_version() >= version;
          },
          std::chrono::seconds(30), std::chrono::milliseconds(50))) {
    return;
  }
  ADD_FAILURE() << run_id << " was not autosaved at learner_version " << version << ": "
                << (run.ok() ? run->DebugString() : run.status().ToString());
}

// The child processes of `pid` (a coordinator's local workers).
inline std::vector<int> ChildPids(int pid) {
  std::vector<int> pids;
  FILE* pipe = popen(absl::StrCat("pgrep -P ", pid).c_str(), "r");
  if (pipe == nullptr) return pids;
  for (int child = 0; fscanf(pipe, "%d", &child) == 1;) pids.push_back(child);
  pclose(pipe);
  return pids;
}

// Sends `signal` to `server` and waits until it and the workers it started have exited (a
// restarted server then finds its port, journal and state folders free).
inline void SignalAndAwaitExit(ChildServer* server, int signal) {
  const std::vector<int> children = ChildPids(server->pid());
  ASSERT_EQ(kill(server->pid(), signal), 0);
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        if (!testing::ProcessGone(server->pid())) return false;
        for (int child : children) {
          if (!testing::ProcessGone(child)) return false;
        }
        return true;
      },
      std::chrono::seconds(30)))
      << "the server or one of its workers is still running";
}

// Calls `call` until it succeeds or `timeout` passes (a restarted worker or mesh serving
// again), `pause` apart; returns its last answer.
template <typename Call>
auto RetryUntilOk(Call call, std::chrono::milliseconds timeout = std::chrono::seconds(30),
                  std::chrono::milliseconds pause = std::chrono::milliseconds(100)) -> decltype(call()) {
  decltype(call()) answer = absl::UnknownError("not tried");
  testing::WaitFor(
      [&] {
        answer = call();
        return answer.ok();
      },
      timeout, pause);
  return answer;
}

// Restarts (process_test, registration_test).
// The third step of Batch(2), sent by hand so that its request_id can be retried.
inline v1::TrainStepRequest StepAfterTheKill(const std::string& run_id) {
  v1::TrainStepRequest step;
  step.set_run_id(run_id);
  step.set_request_id("after-the-kill");
  step.set_sequence_id(3);
  for (const auto& d : Batch(2)) *step.add_datums() = d;
  *step.mutable_loss() = Ppo();
  *step.mutable_adamw() = Adam();
  return step;
}

// Sends `step` every 200 ms for up to `seconds` while a worker or mesh restarts; each failure
// must be UNAVAILABLE or NOT_FOUND (the run not restored yet) and is counted.
inline absl::StatusOr<v1::StepResponse> RetryWhileRestarting(TrainerClient* client, const v1::TrainStepRequest& step,
                                                     int seconds, int* failures) {
  absl::StatusOr<v1::StepResponse> r = absl::UnknownError("not tried");
  testing::WaitFor(
      [&] {
        r = client->TrainStep(step);
        if (r.ok()) return true;
        ++*failures;
        EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsNotFound(r.status())) << r.status();
        return false;
      },
      std::chrono::seconds(seconds), std::chrono::milliseconds(200));
  return r;
}

// After a restart brought `step3`'s run back and the retry applied it as `applied`: sending
// it again is answered from the record, and the adapter equals that of a fresh run given the
// same three steps without interruption.
inline void ExpectAppliedOnceLikeAnUninterruptedRun(TrainerClient* client, const v1::TrainStepRequest& step3,
                                             const v1::StepResponse& applied) {
  ASSERT_OK_AND_ASSIGN(v1::StepResponse again, client->TrainStep(step3));
  EXPECT_EQ(again.adapter_sha256(), applied.adapter_sha256());
  ASSERT_OK_AND_ASSIGN(RunSession reference, RunSession::Create(client, Lora(), 3));
  for (int i = 0; i < 2; ++i) ASSERT_OK(reference.TrainStep(Batch(i), Ppo(), Adam()).status());
  ASSERT_OK_AND_ASSIGN(v1::StepResponse want, reference.TrainStep(Batch(2), Ppo(), Adam()));
  EXPECT_EQ(applied.adapter_sha256(), want.adapter_sha256());
}

}  // namespace service_testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_SERVICE_TEST_UTIL_H_
