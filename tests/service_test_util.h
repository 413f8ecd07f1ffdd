// Helpers shared by the service tests (service_test.cc) and the process tests
// (process_test.cc): small RL batches, the tiny model on disk, a coordinator with its local
// worker, and waiting for a run's autosave.
#ifndef LORASTEP_TESTS_SERVICE_TEST_UTIL_H_
#define LORASTEP_TESTS_SERVICE_TEST_UTIL_H_

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "clients/cpp/trainer_client.h"
#include "lib/model/model_weights.h"
#include "server/child_server.h"
#include "tests/process_runner.h"
#include "tests/proto_test_util.h"
#include "tests/test_util.h"

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

// ScratchDir(name), with a fresh tiny model (seed 1) written to its "model" folder.
inline absl::StatusOr<std::string> TinyModelDir(const std::string& name) {
  const std::string dir = ScratchDir(name);
  const ModelConfig c = ModelConfigPreset("tiny").value();
  if (absl::Status saved = SaveModel(dir + "/model", c, RandomModelWeights(c, 1)); !saved.ok()) return saved;
  return dir;
}

// A coordinator (and its local worker) serving a fresh tiny model under ScratchDir(name),
// with `extra` flags.
inline absl::StatusOr<ChildServer> StartTinyCoordinator(const std::string& name,
                                                 const std::vector<std::string>& extra = {}) {
  absl::StatusOr<std::string> made = TinyModelDir(name);
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
  for (int i = 0; i < 600; ++i) {
    run = client->GetRun(run_id);
    if (run.ok() && run->has_autosaved_learner_version() && run->autosaved_learner_version() >= version) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << run_id << " was not autosaved at learner_version " << version << ": "
                << (run.ok() ? run->DebugString() : run.status().ToString());
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
  for (int i = 0; i < seconds * 5 && !r.ok(); ++i) {
    r = client->TrainStep(step);
    if (!r.ok()) {
      ++*failures;
      EXPECT_TRUE(absl::IsUnavailable(r.status()) || absl::IsNotFound(r.status())) << r.status();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
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
