// Workers that join a coordinator by registration, with real processes on 127.0.0.1: dead
// workers marked down and replaced, journaled runs and meshes coming back when their workers
// register again, meshes outliving their coordinator, remote workers. Run alone (tests/BUILD:
// exclusive): several bound how fast a failure is seen.
#include <signal.h>
#include <ctime>
#include <sys/time.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include <google/protobuf/util/message_differencer.h>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "clients/cpp/trainer_client.h"
#include "lorastep/v1/worker.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "rpc/proto_convert.h"
#include "lib/io/checkpoint_dir.h"
#include "lib/io/file_util.h"
#include "lib/model/model_weights.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/parallel/process_groups.h"
#include "lib/status_macros.h"
#include "lib/training/trainer.h"
#include "lib/io/state_store.h"
#include "server/child_server.h"
#include "server/run_journal.h"
#include "tests/process_runner.h"
#include "tests/proto_test_util.h"
#include "tests/test_util.h"
#include "tests/service_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using namespace ::lorastep::service_testing;  // NOLINT: the shared helpers, unqualified

// A worker whose process dies is marked down: its run's calls say so, new runs go to the
// workers that are up, health turns NOT_SERVING when none is, and a worker restarted at the
// dead one's address replaces it.
TEST(RegistrationTest, DeadWorkerIsMarkedDownSkippedAndReplaced) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, TinyModelDir("dead_worker"));
  ASSERT_OK_AND_ASSIGN(ChildServer coordinator,
                       ChildServer::Start(Binary("server/lorastep_coordinator"), {"--wait_for_workers"}, 60));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainerClient> client, TrainerClient::Connect(coordinator.address()));
  const std::string port_a = std::to_string(FreeLocalPort());
  auto start_worker = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--model", dir + "/model", "--register_with", coordinator.address()};
    args.insert(args.end(), extra.begin(), extra.end());
    return ChildServer::Start(Binary("worker/lorastep_worker"), args, 60);
  };
  ASSERT_OK_AND_ASSIGN(ChildServer a, start_worker({"--port", port_a}));
  ASSERT_OK_AND_ASSIGN(RunSession run_a, RunSession::Create(client.get(), Lora(), 1));  // on a
  ASSERT_OK_AND_ASSIGN(ChildServer b, start_worker({}));
  ASSERT_OK(run_a.TrainStep(Batch(0), Ppo(), Adam()).status());

  ASSERT_EQ(kill(a.pid(), SIGKILL), 0);
  ASSERT_TRUE(testing::WaitFor([&] { return testing::ProcessGone(a.pid()); }));
  run_a.max_attempts = 1;
  EXPECT_THAT(run_a.TrainStep(Batch(1), Ppo(), Adam()).status(),
              StatusIs(absl::StatusCode::kUnavailable, absl::StrCat("127.0.0.1:", port_a, " is down")));
  // Health says a worker is up once b has registered (right after it serves).
  bool serving = testing::WaitFor([&] {
    absl::StatusOr<bool> healthy = client->Healthy();
    return healthy.ok() && *healthy;
  });
  EXPECT_TRUE(serving) << "b is up";
  for (int i = 0; i < 3; ++i) {  // every new run lands on b, and trains
    ASSERT_OK_AND_ASSIGN(RunSession r, RunSession::Create(client.get(), Lora(), 2 + i));
    ASSERT_OK(r.TrainStep(Batch(0), Ppo(), Adam()).status());
  }
  ASSERT_EQ(kill(b.pid(), SIGKILL), 0);
  ASSERT_TRUE(testing::WaitFor([&] { return testing::ProcessGone(b.pid()); }));
  ASSERT_OK_AND_ASSIGN(RunSession r, RunSession::Attach(client.get(), "run-2"));
  r.max_attempts = 1;
  EXPECT_THAT(r.TrainStep(Batch(1), Ppo(), Adam()).status(), StatusIs(absl::StatusCode::kUnavailable, "is down"));
  ASSERT_OK_AND_ASSIGN(serving, client->Healthy());
  EXPECT_FALSE(serving) << "no worker is up";
  v1::CreateRunRequest none;
  none.set_request_id("none-up");
  *none.mutable_lora() = Lora();
  EXPECT_THAT(client->CreateRun(none), StatusIs(absl::StatusCode::kUnavailable, "no worker is up"));

  ASSERT_OK_AND_ASSIGN(ChildServer a2, start_worker({"--port", port_a}));  // restarted at a's address
  serving = testing::WaitFor([&] {  // it registers right after it serves
    absl::StatusOr<bool> healthy = client->Healthy();
    return healthy.ok() && *healthy;
  });
  EXPECT_TRUE(serving);
  ASSERT_OK_AND_ASSIGN(RunSession fresh, RunSession::Create(client.get(), Lora(), 9));
  ASSERT_OK(fresh.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK_AND_ASSIGN(v1::ListRunsResponse runs, client->ListRuns());
  EXPECT_EQ(runs.runs_size(), 5);  // runs on dead workers stay listed until deleted
  EXPECT_THAT(run_a.TrainStep(Batch(1), Ppo(), Adam()).status(),  // not sent to the new process
              StatusIs(absl::StatusCode::kUnavailable, "is down"));
  ASSERT_OK(client->DeleteRun(run_a.run_id()));  // a run on a dead worker can be deleted
  ASSERT_OK_AND_ASSIGN(runs, client->ListRuns());
  EXPECT_EQ(runs.runs_size(), 4);
}

// Issue 8: registered workers with a journal. A worker killed (SIGKILL) and started again
// at its address by its supervisor registers, and its runs come back from their autosaves;
// then the coordinator itself is killed and started again on its port: the worker, which
// registers every second, is found again and the journaled run re-attached where it was;
// last, the worker is killed and restarted before any call notices.
TEST(RegistrationTest, JournaledRunsComeBackWhenTheirWorkerRegistersAgain) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, TinyModelDir("registered_journal"));
  const std::string coordinator_port = std::to_string(FreeLocalPort());
  auto start_coordinator = [&] {
    return ChildServer::Start(Binary("server/lorastep_coordinator"),
                              {"--wait_for_workers", "--port", coordinator_port, "--journal_dir", dir + "/journal"}, 60);
  };
  ASSERT_OK_AND_ASSIGN(ChildServer coordinator, start_coordinator());
  const std::string worker_port = std::to_string(FreeLocalPort());
  auto start_worker = [&] {
    return ChildServer::Start(Binary("worker/lorastep_worker"),
                              {"--model", dir + "/model", "--port", worker_port, "--state_dir", dir + "/store",
                               "--register_with", coordinator.address(), "--register_every_s", "1"},
                              60);
  };
  ASSERT_OK_AND_ASSIGN(ChildServer worker, start_worker());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainerClient> client, TrainerClient::Connect(coordinator.address()));
  // The worker registers right after it serves.
  absl::StatusOr<RunSession> created = RetryUntilOk([&] { return RunSession::Create(client.get(), Lora(), 3); });
  ASSERT_OK(created.status());
  RunSession run = *std::move(created);
  for (int i = 0; i < 2; ++i) ASSERT_OK(run.TrainStep(Batch(i), Ppo(), Adam()).status());

  WaitUntilAutosaved(client.get(), run.run_id(), 2);
  ASSERT_EQ(kill(worker.pid(), SIGKILL), 0);
  const v1::TrainStepRequest step3 = StepAfterTheKill(run.run_id());
  EXPECT_THAT(client->TrainStep(step3).status(),
              StatusIs(absl::StatusCode::kUnavailable, "when a worker registers at that address again"));
  ASSERT_OK_AND_ASSIGN(ChildServer back, start_worker());
  int failures = 0;
  absl::StatusOr<v1::StepResponse> r = RetryWhileRestarting(client.get(), step3, 60, &failures);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->learner_version(), 3);

  WaitUntilAutosaved(client.get(), run.run_id(), 3);
  SignalAndAwaitExit(&coordinator, SIGKILL);
  ASSERT_OK_AND_ASSIGN(ChildServer restarted, start_coordinator());
  ASSERT_OK_AND_ASSIGN(client, TrainerClient::Connect(restarted.address()));
  // Until the worker registers again.
  absl::StatusOr<v1::Run> found = RetryUntilOk([&] { return client->GetRun(run.run_id()); });
  ASSERT_OK(found.status());
  EXPECT_EQ(found->learner_version(), 3);
  v1::TrainStepRequest step4 = StepAfterTheKill(run.run_id());
  step4.set_request_id("after-the-coordinator");
  step4.set_sequence_id(found->next_sequence_id());
  ASSERT_OK_AND_ASSIGN(v1::StepResponse fourth, client->TrainStep(step4));
  EXPECT_EQ(fourth.learner_version(), 4);

  // The worker restarted before any call finds it dead: its registration, from a new process
  // at the known address, tells the coordinator, and the run comes back from its autosave.
  WaitUntilAutosaved(client.get(), run.run_id(), 4);
  ASSERT_EQ(kill(back.pid(), SIGKILL), 0);
  ASSERT_OK_AND_ASSIGN(ChildServer again, start_worker());
  v1::TrainStepRequest step5 = step4;
  step5.set_request_id("after-a-quick-restart");
  step5.set_sequence_id(step4.sequence_id() + 1);
  failures = 0;
  r = RetryWhileRestarting(client.get(), step5, 60, &failures);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->learner_version(), 5);
}

// A DP2 mesh on gloo whose workers join a --wait_for_workers coordinator by registration
// (ranks in the order they ask), with a journal and one shared state store.
struct RegisteredMesh {
  std::string dir;
  std::string coordinator_port = std::to_string(FreeLocalPort());
  std::string rendezvous_port = std::to_string(FreeLocalPort());
  absl::StatusOr<ChildServer> StartCoordinator() const {
    return ChildServer::Start(Binary("server/lorastep_coordinator"),
                              {"--wait_for_workers", "--dp", "2", "--port", coordinator_port, "--rendezvous_port",
                               rendezvous_port, "--journal_dir", dir + "/journal", "--peer_failure_grace_s", "2"},
                              60);
  }
  // Started one after the other, a worker asks for its rank before it serves: the first is
  // rank 0 (or the dead rank a replacement takes).
  absl::StatusOr<ChildServer> StartWorker() const {
    return ChildServer::Start(Binary("worker/lorastep_worker"),
                              {"--model", dir + "/model", "--state_dir", dir + "/store", "--register_with",
                               "127.0.0.1:" + coordinator_port, "--register_every_s", "1", "--collective_timeout_s",
                               "10"},
                              60);
  }
};

absl::StatusOr<RunSession> CreateOnceRegistered(TrainerClient* client) {
  // Workers register right after they serve.
  return RetryUntilOk([&] { return RunSession::Create(client, Lora(), 3); });
}

// A coordinator and both ranks of `mesh`, and a run with two steps, the second autosaved.
struct RegisteredMeshWithARun {
  std::optional<ChildServer> coordinator;
  std::vector<ChildServer> ranks;
  std::unique_ptr<TrainerClient> client;
  std::optional<RunSession> run;
};
absl::StatusOr<RegisteredMeshWithARun> StartWithARun(const RegisteredMesh& mesh) {
  RegisteredMeshWithARun m;
  LORASTEP_ASSIGN_OR_RETURN(ChildServer coordinator, mesh.StartCoordinator());
  m.coordinator.emplace(std::move(coordinator));
  for (int r = 0; r < 2; ++r) {
    LORASTEP_ASSIGN_OR_RETURN(ChildServer rank, mesh.StartWorker());
    m.ranks.push_back(std::move(rank));
  }
  LORASTEP_ASSIGN_OR_RETURN(m.client, TrainerClient::Connect(m.coordinator->address()));
  LORASTEP_ASSIGN_OR_RETURN(RunSession run, CreateOnceRegistered(m.client.get()));
  for (int i = 0; i < 2; ++i) LORASTEP_RETURN_IF_ERROR(run.TrainStep(Batch(i), Ppo(), Adam()).status());
  WaitUntilAutosaved(m.client.get(), run.run_id(), 2);
  m.run.emplace(std::move(run));
  return m;
}

// Issue 8: a rank of a mesh joined by registration killed (SIGKILL); a new worker started by
// its supervisor asks the coordinator for a rank, gets the dead one's, and registers. Once
// the mesh is whole every rank forms a new generation (rank 0's replacement serves a fresh
// TCPStore, at the address the coordinator now sends) and the run comes back from its
// autosave; the client's retry applies the step once, equal to an uninterrupted run.
void RegisteredMeshRankComesBack(int killed_rank) {
  if (!CpuCollectivesAvailable()) GTEST_SKIP() << "a CPU mesh needs a build with gloo";
  RegisteredMesh mesh;
  ASSERT_OK_AND_ASSIGN(mesh.dir, TinyModelDir(absl::StrCat("registered_mesh_", killed_rank)));
  ASSERT_OK_AND_ASSIGN(RegisteredMeshWithARun m, StartWithARun(mesh));
  std::vector<ChildServer>& ranks = m.ranks;
  std::unique_ptr<TrainerClient>& client = m.client;
  RunSession& run = *m.run;
  ASSERT_EQ(kill(ranks[killed_rank].pid(), SIGKILL), 0);
  const v1::TrainStepRequest step3 = StepAfterTheKill(run.run_id());
  EXPECT_THAT(client->TrainStep(step3).status(),
              StatusIs(absl::StatusCode::kUnavailable, "once a worker has registered in the dead rank's place"));
  ASSERT_OK_AND_ASSIGN(ranks[killed_rank], mesh.StartWorker());
  int failures = 0;
  absl::StatusOr<v1::StepResponse> r = RetryWhileRestarting(client.get(), step3, 120, &failures);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->learner_version(), 3);
  ExpectAppliedOnceLikeAnUninterruptedRun(client.get(), step3, *r);
  // A third worker still finds every rank taken (and answering).
  EXPECT_FALSE(mesh.StartWorker().ok());
}

TEST(RegistrationTest, RegisteredMeshRankReplacedByANewWorkerGetsItsRunsBack) { RegisteredMeshRankComesBack(1); }
TEST(RegistrationTest, RegisteredMeshRankZeroReplacedServesTheStoreAgain) { RegisteredMeshRankComesBack(0); }

// Without a journal a registered mesh still takes a new worker in a dead rank's place: the
// old run's state is lost (its calls say so), and new runs train on the mesh again.
TEST(RegistrationTest, RegisteredMeshWithoutJournalTrainsNewRunsAfterARankIsReplaced) {
  if (!CpuCollectivesAvailable()) GTEST_SKIP() << "a CPU mesh needs a build with gloo";
  ASSERT_OK_AND_ASSIGN(const std::string dir, TinyModelDir("registered_mesh_nojournal"));
  const std::string coordinator_port = std::to_string(FreeLocalPort());
  ASSERT_OK_AND_ASSIGN(ChildServer coordinator,
                       ChildServer::Start(Binary("server/lorastep_coordinator"),
                                          {"--wait_for_workers", "--dp", "2", "--port", coordinator_port,
                                           "--rendezvous_port", std::to_string(FreeLocalPort()),
                                           "--peer_failure_grace_s", "2"},
                                          60));
  auto start_worker = [&] {
    return ChildServer::Start(Binary("worker/lorastep_worker"),
                              {"--model", dir + "/model", "--state_dir", dir + "/store", "--register_with",
                               "127.0.0.1:" + coordinator_port, "--collective_timeout_s", "10"},
                              60);
  };
  std::vector<ChildServer> ranks;
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK_AND_ASSIGN(ChildServer rank, start_worker());
    ranks.push_back(std::move(rank));
  }
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(coordinator.address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, CreateOnceRegistered(client.get()));
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_EQ(kill(ranks[1].pid(), SIGKILL), 0);
  run.max_attempts = 1;
  EXPECT_FALSE(run.TrainStep(Batch(1), Ppo(), Adam()).ok());
  ASSERT_OK_AND_ASSIGN(ranks[1], start_worker());
  EXPECT_THAT(run.TrainStep(Batch(1), Ppo(), Adam()).status(), StatusIs(absl::StatusCode::kUnavailable, "lost"));
  ASSERT_OK_AND_ASSIGN(RunSession fresh, CreateOnceRegistered(client.get()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse trained, fresh.TrainStep(Batch(0), Ppo(), Adam()));
  EXPECT_EQ(trained.learner_version(), 1);
}

// Issue 8: the coordinator of a registered mesh killed and started again on its port: the
// ranks, registering every second, make the mesh whole again and the journaled run comes
// back where it was. Then a rank is killed and its replacement asks for a rank before any
// call noticed the death: the coordinator finds the old process gone, hands its rank out,
// and the run comes back from its autosave.
TEST(RegistrationTest, RegisteredMeshOutlivesItsCoordinatorAndAQuietRankDeath) {
  if (!CpuCollectivesAvailable()) GTEST_SKIP() << "a CPU mesh needs a build with gloo";
  RegisteredMesh mesh;
  ASSERT_OK_AND_ASSIGN(mesh.dir, TinyModelDir("registered_mesh_restarts"));
  ASSERT_OK_AND_ASSIGN(RegisteredMeshWithARun m, StartWithARun(mesh));
  std::vector<ChildServer>& ranks = m.ranks;
  std::unique_ptr<TrainerClient>& client = m.client;
  RunSession& run = *m.run;

  SignalAndAwaitExit(&*m.coordinator, SIGKILL);
  ASSERT_OK_AND_ASSIGN(ChildServer restarted, mesh.StartCoordinator());
  ASSERT_OK_AND_ASSIGN(client, TrainerClient::Connect(restarted.address()));
  const v1::TrainStepRequest step3 = StepAfterTheKill(run.run_id());
  int failures = 0;
  absl::StatusOr<v1::StepResponse> r = RetryWhileRestarting(client.get(), step3, 60, &failures);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->learner_version(), 3);
  ExpectAppliedOnceLikeAnUninterruptedRun(client.get(), step3, *r);

  WaitUntilAutosaved(client.get(), run.run_id(), 3);
  ASSERT_EQ(kill(ranks[1].pid(), SIGKILL), 0);
  ASSERT_OK_AND_ASSIGN(ranks[1], mesh.StartWorker());  // before any call finds rank 1 dead
  v1::TrainStepRequest step4 = StepAfterTheKill(run.run_id());
  step4.set_request_id("after-a-quiet-death");
  step4.set_sequence_id(4);
  r = RetryWhileRestarting(client.get(), step4, 120, &failures);
  ASSERT_OK(r.status());
  EXPECT_EQ(r->learner_version(), 4);
}

TEST(RegistrationTest, RemoteWorkersRegisterAndServeRuns) {
  const std::string dir = ScratchDir("registry");
  ModelConfig c = ModelConfigPreset("tiny").value();
  ASSERT_OK(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)));
  ModelConfig other = c;
  other.vocab_size = 128;
  ASSERT_OK(SaveModel(dir + "/other", other, RandomModelWeights(other, 2)));
  ASSERT_OK_AND_ASSIGN(ChildServer coordinator,
                       ChildServer::Start(Binary("server/lorastep_coordinator"),
                                          {"--wait_for_workers"}, 60));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainerClient> client,
                       TrainerClient::Connect(coordinator.address()));
  v1::CreateRunRequest early;
  early.set_request_id("early");
  *early.mutable_lora() = Lora();
  EXPECT_THAT(client->CreateRun(early), StatusIs(absl::StatusCode::kUnavailable, "0 of 1 workers registered"));

  ASSERT_OK_AND_ASSIGN(ChildServer worker,
                       ChildServer::Start(Binary("worker/lorastep_worker"),
                                          {"--model", dir + "/model", "--register_with",
                                           coordinator.address()},
                                          60));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 1));  // retries
  ASSERT_OK_AND_ASSIGN(v1::StepResponse step, run.TrainStep(Batch(0), Ppo(), Adam()));
  EXPECT_EQ(step.learner_version(), 1);

  // A worker serving another model is refused; an empty address is invalid.
  ASSERT_OK_AND_ASSIGN(ChildServer stranger,
                       ChildServer::Start(Binary("worker/lorastep_worker"),
                                          {"--model", dir + "/other"}, 60));
  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto registry = v1::Registry::NewStub(channel);
  v1::RegisterWorkerRequest req;
  req.set_address(stranger.address());
  EXPECT_THAT((CallUnary<v1::RegisterWorkerResponse>(registry.get(),
                                                      &v1::Registry::Stub::RegisterWorker, req,
                                                      std::chrono::seconds(0), testing::ClusterAuthorization())),
              StatusIs(absl::StatusCode::kFailedPrecondition, "serves"));
  req.set_address("");
  EXPECT_THAT((CallUnary<v1::RegisterWorkerResponse>(registry.get(),
                                                      &v1::Registry::Stub::RegisterWorker, req,
                                                      std::chrono::seconds(0), testing::ClusterAuthorization())),
              StatusIs(absl::StatusCode::kInvalidArgument, "address: required"));
  // Joining a mesh: this coordinator runs none; a host is required.
  v1::JoinMeshRequest join;
  join.set_host("127.0.0.1");
  EXPECT_THAT((CallUnary<v1::JoinMeshResponse>(registry.get(), &v1::Registry::Stub::JoinMesh, join, std::chrono::seconds(0),
                                               testing::ClusterAuthorization())),
              StatusIs(absl::StatusCode::kFailedPrecondition, "runs no mesh"));
  join.set_host("");
  EXPECT_THAT((CallUnary<v1::JoinMeshResponse>(registry.get(), &v1::Registry::Stub::JoinMesh, join, std::chrono::seconds(0),
                                               testing::ClusterAuthorization())),
              StatusIs(absl::StatusCode::kInvalidArgument, "host: required"));
}

}  // namespace
}  // namespace lorastep
