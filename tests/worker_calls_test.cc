// WorkerCalls (worker/worker_calls.h), the Worker API's calls without gRPC that both the
// worker process and the coordinator's in-process worker run: the exactly-once record under
// concurrent retries of one request_id, a request_id reused for another method, and a failed
// call that records nothing; and the same calls over the call pipe of a spawned worker.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/match.h"
#include "lib/model/model_weights.h"
#include "lib/training/batch.h"
#include "rpc/proto_convert.h"
#include "tests/proto_test_util.h"
#include "tests/test_util.h"
#include "rpc/call_pipe.h"
#include "rpc/packed_wire.h"
#include "server/grpc_worker_client.h"
#include "worker/worker_calls.h"
#include "worker/worker_core.h"
#include "worker/worker_dispatch.h"
#include "worker/worker_pipe_service.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

// Every co-scheduled step lasts at least `min` (a long step on a small model), through the
// core's fault points around a step's work.
class StepsLastAtLeast : public FaultPoints {
 public:
  explicit StepsLastAtLeast(std::chrono::milliseconds min) : min_(min) {}
  absl::Status At(absl::string_view point) override {
    if (absl::StartsWith(point, "CoscheduledStepBegan:")) began_ = std::chrono::steady_clock::now();
    // A long step is what the tests below need (the window's behaviour around one): time is the subject.
    if (absl::StartsWith(point, "CoscheduledStepEnded:")) std::this_thread::sleep_until(began_ + min_);
    return absl::OkStatus();
  }

 private:
  const std::chrono::milliseconds min_;
  std::chrono::steady_clock::time_point began_;  // the co-scheduling thread's own
};

using ::lorastep::testing::StatusIs;

class WorkerCallsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = lorastep::testing::ScratchDir("worker_calls");
    const ModelConfig c = ModelConfigPreset("tiny").value();
    ASSERT_OK(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)));
    WorkerOptions options;
    options.model_path = dir + "/model";
    ASSERT_OK_AND_ASSIGN(core_, WorkerCore::Create(options));
    calls_ = std::make_unique<WorkerCalls>(core_.get());
    ASSERT_OK(CreateRun());
  }

  // Run `run_id`: LoRA rank 4, seed 3.
  absl::Status CreateRun(const std::string& run_id = "r") {
    v1::WorkerCreateRunRequest create;
    create.set_run_id(run_id);
    create.mutable_lora()->set_rank(4);
    create.mutable_lora()->set_alpha(8);
    create.set_seed(3);
    v1::WorkerCreateRunResponse created;
    return calls_->CreateRun(create, &created);
  }

  // A TrainStep of batch `step` (`sequences` x `length` tokens) under `request_id` ("" = not
  // recorded), expected to find the run at learner version `step` (as the coordinator says
  // with every recorded call).
  static v1::WorkerTrainStepRequest Step(int step, const std::string& request_id, int sequences = 4, int length = 8) {
    v1::WorkerTrainStepRequest req;
    req.set_run_id("r");
    req.mutable_mesh()->set_request_id(request_id);
    req.mutable_mesh()->set_expected_learner_version(step);
    std::vector<v1::Datum> batch;
    for (int i = 0; i < sequences; ++i) batch.push_back(lorastep::testing::RlDatum(i, step, length, 96));
    EXPECT_TRUE(PackDatums(batch, req.mutable_packed_datums()));
    google::protobuf::RepeatedPtrField<v1::Datum> as_proto(batch.begin(), batch.end());
    const BatchTotals totals = ComputeBatchTotals(DatumsFromProto(as_proto));
    req.set_batch_loss_tokens(totals.loss_tokens);
    req.set_batch_samples(totals.samples);
    req.mutable_loss()->set_loss_fn("ppo");
    req.mutable_adamw()->set_lr(1e-2);
    return req;
  }

  std::unique_ptr<WorkerCore> core_;
  std::unique_ptr<WorkerCalls> calls_;
};

// A call its caller gave up on before it reached the device is dropped at once, applying
// nothing; the run's next call steps it.
TEST_F(WorkerCallsTest, ACallCancelledBeforeItRunsIsDroppedAndAppliesNothing) {
  v1::WorkerStepResponse resp;
  const absl::Status dropped = calls_->TrainStep(Step(0, "gone"), &resp, nullptr, [] { return true; });
  EXPECT_THAT(dropped, StatusIs(absl::StatusCode::kCancelled, "before it reached the device; nothing was applied"));
  ASSERT_OK(calls_->TrainStep(Step(0, "next"), &resp));
  EXPECT_EQ(resp.result().learner_version(), 1);
}

TEST_F(WorkerCallsTest, ConcurrentRetriesOfOneRequestIdApplyOnce) {
  const v1::WorkerTrainStepRequest req = Step(0, "once");
  std::vector<v1::WorkerStepResponse> responses(4);
  std::vector<absl::Status> statuses(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] { statuses[t] = calls_->TrainStep(req, &responses[t]); });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) {
    ASSERT_OK(statuses[t]);
    EXPECT_EQ(responses[t].result().learner_version(), 1) << t;
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(responses[0], responses[t])) << t;
  }
  // The next step without a request_id is the run's second, not its fifth.
  v1::WorkerStepResponse next;
  ASSERT_OK(calls_->TrainStep(Step(1, ""), &next));
  EXPECT_EQ(next.result().learner_version(), 2);
}

TEST_F(WorkerCallsTest, ReusedRequestIdAndFailedCalls) {
  v1::WorkerStepResponse first;
  ASSERT_OK(calls_->TrainStep(Step(0, "id-1"), &first));
  v1::WorkerOptimStepRequest optim;
  optim.set_run_id("r");
  optim.mutable_mesh()->set_request_id("id-1");
  optim.mutable_mesh()->set_expected_learner_version(1);
  optim.mutable_adamw()->set_lr(1e-2);
  v1::WorkerStepResponse unused;
  EXPECT_THAT(calls_->OptimStep(optim, &unused),
              StatusIs(absl::StatusCode::kInvalidArgument, "request_id: 'id-1' was used for TrainStep"));
  // A failed call records nothing: the same request_id, corrected, then runs.
  v1::WorkerTrainStepRequest bad = Step(1, "id-2");
  bad.mutable_loss()->set_loss_fn("no-such-loss");
  EXPECT_THAT(calls_->TrainStep(bad, &unused), StatusIs(absl::StatusCode::kInvalidArgument, "loss_fn"));
  v1::WorkerStepResponse second;
  ASSERT_OK(calls_->TrainStep(Step(1, "id-2"), &second));
  EXPECT_EQ(second.result().learner_version(), 2);
  EXPECT_NE(second.result().adapter_sha256(), first.result().adapter_sha256());
}

// Request ids are the clients' own: another run's call with the same request_id is its own
// call, applied to it, never answered with the first run's record (its log-probs and digest).
TEST_F(WorkerCallsTest, TheSameRequestIdOnTwoRunsIsTwoCalls) {
  ASSERT_OK(CreateRun("other"));
  v1::WorkerStepResponse first, second, next;
  ASSERT_OK(calls_->TrainStep(Step(0, "step-1"), &first));
  v1::WorkerTrainStepRequest on_other = Step(0, "step-1");
  on_other.set_run_id("other");
  ASSERT_OK(calls_->TrainStep(on_other, &second));
  // Applied on "other" (an answer from r's record would leave it at version 0 and refuse this).
  v1::WorkerTrainStepRequest then = Step(1, "step-2");
  then.set_run_id("other");
  ASSERT_OK(calls_->TrainStep(then, &next));
  EXPECT_EQ(next.result().learner_version(), 2);
  // An id r used for a TrainStep is free for another method on "other".
  v1::WorkerOptimStepRequest optim;
  optim.set_run_id("other");
  optim.mutable_mesh()->set_request_id("step-1-optim");
  ASSERT_OK(calls_->TrainStep(Step(1, "step-1-optim"), &next));
  optim.mutable_mesh()->set_expected_learner_version(2);
  optim.mutable_adamw()->set_lr(1e-2);
  const absl::Status s = calls_->OptimStep(optim, &next);
  EXPECT_THAT(std::string(s.message()), ::testing::Not(::testing::HasSubstr("was used for")));
}

// A run deleted and created again (the coordinator restoring it from its autosave) applies
// a retried request_id: the earlier run's record of it is gone with that run.
TEST_F(WorkerCallsTest, ARunCreatedAgainAppliesARetriedRequestId) {
  v1::WorkerStepResponse first;
  ASSERT_OK(calls_->TrainStep(Step(0, "id-1"), &first));
  v1::WorkerDeleteRunRequest del;
  del.set_run_id("r");
  ASSERT_OK(calls_->DeleteRun(del));
  ASSERT_OK(CreateRun());
  v1::WorkerStepResponse retried;
  ASSERT_OK(calls_->TrainStep(Step(0, "id-1"), &retried));
  EXPECT_EQ(retried.result().learner_version(), 1);
  v1::WorkerStepResponse next;
  // Found at learner version 1: the retry was applied, not answered from a record.
  ASSERT_OK(calls_->TrainStep(Step(1, "id-2"), &next));
  EXPECT_EQ(next.result().learner_version(), 2);
}

// The in-process worker's WorkerCalls keeps no record: a call re-sent with the same
// request_id is not answered from a record, but the learner version it carries still stops
// it from applying twice.
TEST_F(WorkerCallsTest, WithoutRecordsTheLearnerVersionStillRefusesARepeat) {
  WorkerCalls unrecorded(core_.get(), /*metrics=*/nullptr, /*record_calls=*/false);
  v1::WorkerStepResponse first, again;
  ASSERT_OK(unrecorded.TrainStep(Step(0, "id-1"), &first));
  EXPECT_EQ(first.result().learner_version(), 1);
  EXPECT_THAT(unrecorded.TrainStep(Step(0, "id-1"), &again),
              StatusIs(absl::StatusCode::kFailedPrecondition, "learner_version"));
}

// Without the whole batch's totals the call's datums are the whole batch: the trainer
// counts them itself, and the step equals one given the same totals.
TEST_F(WorkerCallsTest, AbsentTotalsMeanTheCallsOwnDatums) {
  v1::WorkerStepResponse with_totals;
  ASSERT_OK(calls_->TrainStep(Step(0, ""), &with_totals));
  // A second run from the same seed, stepped without totals.
  ASSERT_OK(CreateRun("r2"));
  v1::WorkerTrainStepRequest own = Step(0, "");
  own.set_run_id("r2");
  own.clear_batch_loss_tokens();
  own.clear_batch_samples();
  v1::WorkerStepResponse without;
  ASSERT_OK(calls_->TrainStep(own, &without));
  EXPECT_EQ(without.result().adapter_sha256(), with_totals.result().adapter_sha256());
  EXPECT_EQ(without.result().metrics().at("loss:sum"), with_totals.result().metrics().at("loss:sum"));
  // Totals that differ from the datums' own change the step: the field is honoured.
  v1::WorkerTrainStepRequest doubled = Step(1, "");
  doubled.set_batch_loss_tokens(doubled.batch_loss_tokens() * 2);
  v1::WorkerTrainStepRequest same = Step(1, "");
  same.set_run_id("r2");
  v1::WorkerStepResponse a, b;
  ASSERT_OK(calls_->TrainStep(doubled, &a));
  ASSERT_OK(calls_->TrainStep(same, &b));
  EXPECT_NE(a.result().metrics().at("loss:sum"), b.result().metrics().at("loss:sum"));
}


// The call pipe from a coordinator to the worker it spawned (worker/worker_pipe_service.h):
// the coordinator's GrpcWorkerClient over a real socket pair to a WorkerPipeService over this
// fixture's core. A step answers as WorkerCalls does, a refusal travels back as it is, and
// what the worker cannot take (a request that does not parse, a method the pipe does not
// carry, a descriptor that is not a socket) is refused, naming what is wrong.
class WorkerPipeTest : public WorkerCallsTest {
 protected:
  void SetUp() override {
    WorkerCallsTest::SetUp();
    dispatch_ = std::make_unique<WorkerDispatch>(core_.get());
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    ASSERT_OK_AND_ASSIGN(service_, WorkerPipeService::Start(pair[1], dispatch_.get(), &observers_));
    client_fd_ = pair[0];
  }
  void TearDown() override {
    service_.reset();
    dispatch_.reset();
  }

  CallObservers observers_;
  std::unique_ptr<WorkerDispatch> dispatch_;
  std::unique_ptr<WorkerPipeService> service_;
  int client_fd_ = -1;  // taken by the client the test makes
};

TEST_F(WorkerPipeTest, StepsAndRefusalsTravelAsWorkerCallsAnswers) {
  GrpcWorkerClient client("127.0.0.1:1", std::chrono::seconds(600), "", {}, client_fd_);  // no gRPC server there
  ASSERT_OK_AND_ASSIGN(v1::WorkerStepResponse piped, client.TrainStep(Step(0, "p-0"), BatchShard{}));
  EXPECT_EQ(piped.result().learner_version(), 1);
  // The same step on a twin run through WorkerCalls directly gives the same adapter.
  ASSERT_OK(CreateRun("twin"));
  v1::WorkerTrainStepRequest twin = Step(0, "");
  twin.set_run_id("twin");
  v1::WorkerStepResponse direct;
  ASSERT_OK(calls_->TrainStep(twin, &direct));
  EXPECT_EQ(piped.result().adapter_sha256(), direct.result().adapter_sha256());
  EXPECT_EQ(piped.result().metrics().at("loss:sum"), direct.result().metrics().at("loss:sum"));
  // A stale learner version is refused on the worker, and the refusal arrives as it is.
  EXPECT_THAT(client.TrainStep(Step(0, "p-1"), BatchShard{}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "learner_version"));
  // ForwardBackward, Forward and OptimStep travel the same way.
  v1::WorkerForwardRequest forward;
  forward.set_run_id("r");
  *forward.mutable_packed_datums() = Step(1, "").packed_datums();
  ASSERT_OK_AND_ASSIGN(v1::WorkerForwardBackwardResponse scored, client.Forward(forward, BatchShard{}));
  EXPECT_EQ(scored.result().logprobs_size(), 4);
  v1::WorkerOptimStepRequest optim;
  optim.set_run_id("r");
  optim.mutable_adamw()->set_lr(-1);
  EXPECT_THAT(client.OptimStep(optim).status(), StatusIs(absl::StatusCode::kInvalidArgument, "lr"));
}

// A shard of parsed datums (as the coordinator hands them over) travels written after the rest
// of the request, from a wire form of its own or one its ranks share, or as the client packed
// them, and steps as the same datums inside the request do.
TEST_F(WorkerPipeTest, AShardOfParsedDatumsStepsAsTheRequestsOwn) {
  GrpcWorkerClient client("127.0.0.1:1", std::chrono::seconds(600), "", {}, client_fd_);
  const v1::WorkerTrainStepRequest whole = Step(0, "");
  ASSERT_OK_AND_ASSIGN(std::vector<Datum> datums,
                       RequestDatums(google::protobuf::RepeatedPtrField<v1::Datum>(), whole.packed_datums()));
  const std::vector<int> indices = {0, 1, 2, 3};
  ShardWireForms wire(1);
  v1::WorkerStepResponse direct;
  ASSERT_OK(calls_->TrainStep(whole, &direct));
  for (ShardWireForms* forms : {static_cast<ShardWireForms*>(nullptr), &wire}) {
    const std::string run = forms == nullptr ? "own_form" : "shared_form";
    ASSERT_OK(CreateRun(run));
    v1::WorkerTrainStepRequest bare = whole;
    bare.set_run_id(run);
    bare.clear_packed_datums();
    BatchShard shard;
    shard.datums = &datums;
    shard.indices = &indices;
    shard.wire = forms;
    ASSERT_OK_AND_ASSIGN(v1::WorkerStepResponse piped, client.TrainStep(bare, shard));
    EXPECT_EQ(piped.result().adapter_sha256(), direct.result().adapter_sha256()) << run;
  }
  // The client's packed batch passed on in the bytes it came in (BatchShard::as_sent), here
  // in pieces of 64 bytes as gRPC's slices hold it.
  ASSERT_OK(CreateRun("as_sent"));
  v1::WorkerTrainStepRequest bare = whole;
  bare.set_run_id("as_sent");
  bare.clear_packed_datums();
  auto bytes = std::make_shared<const std::string>(whole.packed_datums().SerializeAsString());
  WirePieces pieces;
  for (size_t at = 0; at < bytes->size(); at += 64) pieces.push_back(absl::string_view(*bytes).substr(at, 64));
  ASSERT_GT(pieces.size(), 1u);
  ASSERT_OK_AND_ASSIGN(const PackedDatumsWire as_sent, PackedDatumsWire::Read(pieces, bytes));
  BatchShard shard;
  shard.as_sent = &as_sent;
  ASSERT_OK_AND_ASSIGN(v1::WorkerStepResponse piped, client.TrainStep(bare, shard));
  EXPECT_EQ(piped.result().adapter_sha256(), direct.result().adapter_sha256());
}

// A batch too large to be worth copying through the socket twice (here 16 x 96 tokens, 24 KB)
// lies in the region the coordinator's side shares with the worker (mapped by both, here in
// one process), and steps as the same batch through WorkerCalls directly, step after step as
// its span is reused, staged ahead of its call or not.
TEST_F(WorkerPipeTest, ALargeBatchTravelsThroughTheSharedRegion) {
  GrpcWorkerClient client("127.0.0.1:1", std::chrono::seconds(600), "", {}, client_fd_);
  ASSERT_OK(CreateRun("twin"));
  for (int step = 0; step < 3; ++step) {
    const v1::WorkerTrainStepRequest req = Step(step, "", 16, 96);
    ASSERT_GT(req.ByteSizeLong(), 16u << 10);
    ASSERT_OK_AND_ASSIGN(v1::WorkerStepResponse piped, client.TrainStep(req, BatchShard{}));
    v1::WorkerTrainStepRequest twin = req;
    twin.set_run_id("twin");
    v1::WorkerStepResponse direct;
    ASSERT_OK(calls_->TrainStep(twin, &direct));
    EXPECT_EQ(piped.result().adapter_sha256(), direct.result().adapter_sha256()) << step;
    EXPECT_EQ(piped.result().metrics().at("loss:sum"), direct.result().metrics().at("loss:sum")) << step;
  }
  // The client's packed batch passed on as sent and staged ahead of the call
  // (GrpcWorkerClient::StageBatch, as the coordinator does on the thread that received it):
  // the call sends it from where it was staged.
  const v1::WorkerTrainStepRequest whole = Step(3, "", 16, 96);
  v1::WorkerTrainStepRequest bare = whole;
  bare.clear_packed_datums();
  auto bytes = std::make_shared<const std::string>(whole.packed_datums().SerializeAsString());
  ASSERT_OK_AND_ASSIGN(PackedDatumsWire as_sent, PackedDatumsWire::Read({*bytes}, bytes));
  client.StageBatch(&as_sent);
  ASSERT_NE(as_sent.staged(), nullptr);
  BatchShard shard;
  shard.as_sent = &as_sent;
  ASSERT_OK_AND_ASSIGN(v1::WorkerStepResponse piped, client.TrainStep(bare, shard));
  v1::WorkerTrainStepRequest twin = whole;
  twin.set_run_id("twin");
  v1::WorkerStepResponse direct;
  ASSERT_OK(calls_->TrainStep(twin, &direct));
  EXPECT_EQ(piped.result().adapter_sha256(), direct.result().adapter_sha256());
  std::ifstream maps("/proc/self/maps");
  const std::string all((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
  size_t mappings = 0;
  for (size_t at = all.find("memfd:lorastep-call-pipe"); at != std::string::npos;
       at = all.find("memfd:lorastep-call-pipe", at + 1)) {
    ++mappings;
  }
  EXPECT_EQ(mappings, 2u) << "the coordinator's side writes it, the worker's reads it";
}

TEST_F(WorkerPipeTest, RefusesWhatItCannotTake) {
  CallPipeClient raw(client_fd_, "worker");
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
  EXPECT_THAT(raw.Call(static_cast<uint8_t>(WorkerPipeMethod::kTrainStep), "\xff\xff\xff", deadline).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "does not parse as lorastep.v1.WorkerTrainStepRequest"));
  // The packed datums are read where they lie in the payload: a malformed PackedDatums inside
  // a well-formed request does not parse either, and a batch whose arrays do not match its
  // lengths is refused naming the array, as a parsed one is.
  v1::WorkerTrainStepRequest step = Step(0, "");
  const std::string packed = step.packed_datums().SerializeAsString();
  step.clear_packed_datums();
  std::string garbled = step.SerializeAsString();
  garbled += std::string("\x42\x02\x12\xff", 4);  // field 8, 2 bytes: a tokens field cut short
  EXPECT_THAT(raw.Call(static_cast<uint8_t>(WorkerPipeMethod::kTrainStep), garbled, deadline).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "does not parse as lorastep.v1.WorkerTrainStepRequest"));
  v1::WorkerTrainStepRequest short_tokens = Step(0, "");
  short_tokens.mutable_packed_datums()->mutable_tokens()->resize(8);
  EXPECT_THAT(raw.Call(static_cast<uint8_t>(WorkerPipeMethod::kTrainStep), short_tokens.SerializeAsString(), deadline)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "packed_datums.tokens: 8 bytes"));
  EXPECT_THAT(raw.Call(99, "", deadline).status(), StatusIs(absl::StatusCode::kInvalidArgument, "method: 99"));
  EXPECT_THAT(WorkerPipeService::Start(-1, dispatch_.get(), &observers_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "coordinator_pipe_fd"));
  const std::string file = lorastep::testing::ScratchDir("worker_pipe") + "/not_a_socket";
  const int fd = open(file.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  EXPECT_THAT(WorkerPipeService::Start(fd, dispatch_.get(), &observers_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "coordinator_pipe_fd"));
  close(fd);
}

// The coordinator's side refuses an answer that is not the method's response.
TEST(WorkerPipeClientTest, AnAnswerThatDoesNotParseIsDataLoss) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  CallPipeServer garbled(pair[1], 1 << 20, [](uint8_t, CallPayload, std::function<bool()>,
                                              CallPipeServer::Respond respond) { respond(absl::OkStatus(), "\xff\xff"); });
  GrpcWorkerClient client("127.0.0.1:1", std::chrono::seconds(60), "", {}, pair[0]);
  v1::WorkerOptimStepRequest optim;
  optim.set_run_id("r");
  EXPECT_THAT(client.OptimStep(optim).status(),
              StatusIs(absl::StatusCode::kDataLoss, "does not parse as lorastep.v1.WorkerStepResponse"));
}

// Co-scheduling (WorkerOptions::coschedule_window): TrainSteps of two runs sent at once run
// as one step (co_scheduled_runs:max 2), each with the loss and grad_norm of the same run's
// step on a worker that runs every call alone; a call whose batch is refused fails alone
// while the other run steps; a worker holding one run never waits for the window (its calls
// skip the queue).
TEST(CoschedulingTest, ConcurrentStepsOfTwoRunsShareOneStep) {
  const std::string dir = lorastep::testing::ScratchDir("coscheduling");
  const ModelConfig c = ModelConfigPreset("tiny").value();
  ASSERT_OK(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)));
  auto make_core = [&](std::chrono::microseconds window) {
    WorkerOptions options;
    options.model_path = dir + "/model";
    options.coschedule_window = window;
    return WorkerCore::Create(options);
  };
  LoraConfig lora_a, lora_b;
  lora_a.rank = 4, lora_a.alpha = 8, lora_a.target_modules = {"all-linear"};
  lora_b.rank = 2, lora_b.alpha = 4, lora_b.target_modules = {"q_proj", "v_proj"};
  ASSERT_OK_AND_ASSIGN(auto alone, make_core(std::chrono::microseconds(0)));
  ASSERT_OK_AND_ASSIGN(auto together, make_core(std::chrono::seconds(2)));  // the threads surely meet in it
  for (WorkerCore* core : {alone.get(), together.get()}) {
    ASSERT_OK(core->CreateRun("a", lora_a, 3).status());
    ASSERT_OK(core->CreateRun("b", lora_b, 5).status());
  }
  auto batch = [](int step) {
    std::vector<v1::Datum> protos;
    for (int i = 0; i < 3; ++i) protos.push_back(lorastep::testing::RlDatum(i, step, 6 + i, 96));
    google::protobuf::RepeatedPtrField<v1::Datum> field(protos.begin(), protos.end());
    return DatumsFromProto(field);
  };
  const std::vector<Datum> batch_a = batch(0), batch_b = batch(1);
  LossConfig ppo;
  ppo.kind = LossKind::kPpo;
  AdamWParams adam;
  adam.lr = 1e-2;
  absl::StatusOr<OptimStepResult> want_a = alone->TrainStep("a", batch_a, ppo, adam, nullptr, 0);
  absl::StatusOr<OptimStepResult> want_b = alone->TrainStep("b", batch_b, ppo, adam, nullptr, 0);
  ASSERT_OK(want_a.status());
  ASSERT_OK(want_b.status());
  EXPECT_FALSE(want_a->metrics.Has("co_scheduled_runs:max"));
  absl::StatusOr<OptimStepResult> got_a = absl::UnknownError(""), got_b = absl::UnknownError("");
  {
    std::thread ta([&] { got_a = together->TrainStep("a", batch_a, ppo, adam, nullptr, 0); });
    std::thread tb([&] { got_b = together->TrainStep("b", batch_b, ppo, adam, nullptr, 0); });
    ta.join();
    tb.join();
  }
  ASSERT_OK(got_a.status());
  ASSERT_OK(got_b.status());
  for (const auto& [got, want] : {std::pair(&*got_a, &*want_a), std::pair(&*got_b, &*want_b)}) {
    EXPECT_EQ(got->metrics.Get("co_scheduled_runs:max"), 2.0);
    EXPECT_NEAR(got->metrics.Get("loss:sum"), want->metrics.Get("loss:sum"), 1e-6 * std::abs(want->metrics.Get("loss:sum")));
    EXPECT_NEAR(got->metrics.Get("grad_norm:sum"), want->metrics.Get("grad_norm:sum"),
                1e-6 * want->metrics.Get("grad_norm:sum"));
    EXPECT_EQ(got->learner_version, 1);
  }
  // A refused batch fails alone.
  std::vector<Datum> oov = batch(2);
  oov[0].tokens[0] = 96;
  {
    std::thread ta([&] { got_a = together->TrainStep("a", batch(3), ppo, adam, nullptr, 0); });
    std::thread tb([&] { got_b = together->TrainStep("b", oov, ppo, adam, nullptr, 0); });
    ta.join();
    tb.join();
  }
  ASSERT_OK(got_a.status());
  EXPECT_EQ(got_a->learner_version, 2);
  EXPECT_THAT(got_b.status(), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  EXPECT_TRUE(got_a->metrics.Has("time_coschedule_wait_s:sum"));  // beside another run: queued
  // A worker holding one run: its calls skip the co-scheduling queue (no window, no wait).
  ASSERT_OK_AND_ASSIGN(auto lone, make_core(std::chrono::seconds(2)));
  ASSERT_OK(lone->CreateRun("a", lora_a, 3).status());
  {
    ASSERT_OK_AND_ASSIGN(OptimStepResult step, lone->TrainStep("a", batch_a, ppo, adam, nullptr, 0));
    EXPECT_FALSE(step.metrics.Has("time_coschedule_wait_s:sum"));  // it never queued
  }
  // An idle run costs the others at most one window: run "a" steps alone beside "b", which
  // sends nothing; its first step waits out the window for b (created, so presumed active),
  // its next ones do not.
  ASSERT_OK_AND_ASSIGN(auto idle, make_core(std::chrono::seconds(2)));
  ASSERT_OK(idle->CreateRun("a", lora_a, 3).status());
  ASSERT_OK(idle->CreateRun("b", lora_b, 5).status());
  {  // the step b missed says so (co_scheduled_missed_runs), the later ones expect b no more
    ASSERT_OK_AND_ASSIGN(OptimStepResult first, idle->TrainStep("a", batch_a, ppo, adam, nullptr, 0));
    EXPECT_EQ(first.metrics.Get("co_scheduled_missed_runs:max"), 1.0);
  }
  for (int i = 0; i < 2; ++i) {
    const auto began = std::chrono::steady_clock::now();
    ASSERT_OK_AND_ASSIGN(OptimStepResult next, idle->TrainStep("a", batch_a, ppo, adam, nullptr, 0));
    EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(1)) << "step " << i + 2;
    EXPECT_TRUE(next.metrics.Has("co_scheduled_missed_runs:max")) << "step " << i + 2;
    EXPECT_EQ(next.metrics.Get("co_scheduled_missed_runs:max"), 0.0) << "step " << i + 2;
  }
  // The window stays open past its first length while the expected runs keep arriving: calls
  // 0.6 s apart under a 1 s window all join the step, though the last comes 1.2 s after the first.
  ASSERT_OK_AND_ASSIGN(auto staggered, make_core(std::chrono::seconds(1)));
  for (const char* run : {"a", "b", "c"}) ASSERT_OK(staggered->CreateRun(run, lora_a, 3).status());
  {
    std::vector<absl::StatusOr<OptimStepResult>> got(3, absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back([&, i] {
        std::this_thread::sleep_for(std::chrono::milliseconds(600 * i));  // arrivals spaced in time: the subject
        got[i] = staggered->TrainStep(std::string(1, static_cast<char>('a' + i)), batch(i), ppo, adam, nullptr, 0);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK(got[i].status());
      EXPECT_EQ(got[i]->metrics.Get("co_scheduled_runs:max"), 3.0) << "run " << i;
      EXPECT_TRUE(got[i]->metrics.Has("co_scheduled_missed_runs:max")) << "run " << i;
      EXPECT_EQ(got[i]->metrics.Get("co_scheduled_missed_runs:max"), 0.0) << "run " << i;
      // The window opened at the first call; the last came about 1.2 s later.
      EXPECT_GT(got[i]->metrics.Get("time_coschedule_last_arrival_s:sum"), 1.0) << "run " << i;
      EXPECT_LT(got[i]->metrics.Get("time_coschedule_last_arrival_s:sum"), 2.0) << "run " << i;
    }
  }
  // After a long step the window waits longer for stragglers (a tenth of that step, beyond
  // four windows): eight runs' calls 100 ms apart under a 150 ms window, the last 700 ms after
  // the first (past four windows, 600 ms), all join the step that follows a 10 s step.
  {
    WorkerOptions options;
    options.model_path = dir + "/model";
    options.coschedule_window = std::chrono::milliseconds(150);
    options.faults = std::make_shared<StepsLastAtLeast>(std::chrono::seconds(10));
    ASSERT_OK_AND_ASSIGN(auto slow, WorkerCore::Create(options));
    const int runs = 8;
    for (int i = 0; i < runs; ++i) ASSERT_OK(slow->CreateRun(std::string(1, static_cast<char>('a' + i)), lora_a, 3).status());
    for (int round = 0; round < 2; ++round) {  // the first round's step lasts 10 s; the second's window follows it
      std::vector<absl::StatusOr<OptimStepResult>> got(runs, absl::UnknownError(""));
      std::vector<std::thread> threads;
      for (int i = 0; i < runs; ++i) {
        threads.emplace_back([&, i] {
          // Arrivals spaced in time within the window: the subject.
          if (round == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100 * i));
          got[i] = slow->TrainStep(std::string(1, static_cast<char>('a' + i)), batch(i), ppo, adam, nullptr, 0);
        });
      }
      for (std::thread& t : threads) t.join();
      for (int i = 0; i < runs; ++i) {
        ASSERT_OK(got[i].status());
        if (round == 1) {
          EXPECT_EQ(got[i]->metrics.Get("co_scheduled_runs:max"), runs) << "run " << i;
        }
      }
    }
  }
  // Runs that answer in lock step are not split by a straggler: "a" and "b" each send their
  // next call 300 ms after their answer, longer than the 150 ms window, and b's first call
  // misses a's first step. The steps then alternate (a, b, a) while the waiting run's
  // turnaround is unknown; once a's is known (300 ms, within the 600 ms cap), the window that
  // b's call, queued during the third step, opens holds for a, and the fourth step takes both.
  {
    WorkerOptions options;
    options.model_path = dir + "/model";
    options.coschedule_window = std::chrono::milliseconds(150);
    options.faults = std::make_shared<StepsLastAtLeast>(std::chrono::seconds(1));
    ASSERT_OK_AND_ASSIGN(auto paired, WorkerCore::Create(options));
    for (const char* run : {"a", "b"}) ASSERT_OK(paired->CreateRun(run, lora_a, 3).status());
    std::vector<std::vector<absl::StatusOr<OptimStepResult>>> got(2);
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        // Arrival times are the subject: b joins late, and each run's calls come 300 ms apart.
        if (i == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
        for (int call = 0; call < 3; ++call) {
          if (call > 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
          got[i].push_back(paired->TrainStep(i == 0 ? "a" : "b", batch(call), ppo, adam, nullptr, 0));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    std::vector<std::vector<double>> runs_a_step(2);
    for (int i = 0; i < 2; ++i) {
      for (const auto& call : got[i]) {
        ASSERT_OK(call.status());
        // A call that ran alone has no co_scheduled_runs.
        runs_a_step[i].push_back(call->metrics.Has("co_scheduled_runs:max") ? call->metrics.Get("co_scheduled_runs:max") : 1.0);
      }
    }
    EXPECT_THAT(runs_a_step[0], ::testing::ElementsAre(1.0, 1.0, 2.0));  // a: steps 1, 3, 4
    EXPECT_THAT(runs_a_step[1], ::testing::ElementsAre(1.0, 2.0, 1.0));  // b: steps 2, 4, 5
    // The device's time between steps: none before the worker's first; before the fourth, a's
    // way back (300 ms after step 3 ended).
    EXPECT_FALSE(got[0][0]->metrics.Has("time_coschedule_between_steps_s:sum"));
    ASSERT_TRUE(got[0][2]->metrics.Has("time_coschedule_between_steps_s:sum"));
    EXPECT_GT(got[0][2]->metrics.Get("time_coschedule_between_steps_s:sum"), 0.25);
    EXPECT_LT(got[0][2]->metrics.Get("time_coschedule_between_steps_s:sum"), 0.6);
    // a sent no fourth call: b's last call found the device free (no stragglers queued), so it
    // waited the window for a (0.15 s), not a's turnaround (the hold would end 0.45 s after it).
    ASSERT_TRUE(got[1][2]->metrics.Has("time_coschedule_wait_s:sum"));
    EXPECT_GT(got[1][2]->metrics.Get("time_coschedule_wait_s:sum"), 0.1);
    EXPECT_LT(got[1][2]->metrics.Get("time_coschedule_wait_s:sum"), 0.3);
  }
  // One run on the worker: nothing to wait for, the call runs alone at once.
  ASSERT_OK_AND_ASSIGN(auto single, make_core(std::chrono::seconds(2)));
  ASSERT_OK(single->CreateRun("only", lora_a, 3).status());
  absl::StatusOr<OptimStepResult> only = single->TrainStep("only", batch_a, ppo, adam, nullptr, 0);
  ASSERT_OK(only.status());
  EXPECT_FALSE(only->metrics.Has("time_coschedule_wait_s:sum"));  // it never queued
  EXPECT_FALSE(only->metrics.Has("co_scheduled_runs:max"));

  // Forward calls join too: two runs' Forwards sent at once share one forward and give what
  // each run's Forward gives alone; a Forward and another run's TrainStep sent at once are
  // taken by one step (the TrainStep's loss as alone).
  absl::StatusOr<ForwardBackwardResult> fa = absl::UnknownError(""), fb = absl::UnknownError("");
  {
    std::thread ta([&] { fa = together->Forward("a", batch_a); });
    std::thread tb([&] { fb = together->Forward("b", batch_b); });
    ta.join();
    tb.join();
  }
  ASSERT_OK(fa.status());
  ASSERT_OK(fb.status());
  ASSERT_OK_AND_ASSIGN(auto fresh, make_core(std::chrono::microseconds(0)));
  ASSERT_OK(fresh->CreateRun("b", lora_b, 5).status());
  ASSERT_OK(fresh->TrainStep("b", batch_b, ppo, adam, nullptr, 0).status());  // as `together`'s b so far
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult want_fb, fresh->Forward("b", batch_b));
  EXPECT_EQ(fa->metrics.Get("co_scheduled_runs:max"), 2.0);
  EXPECT_EQ(fb->metrics.Get("co_scheduled_runs:max"), 2.0);
  ASSERT_EQ(fb->logprobs.size(), want_fb.logprobs.size());
  for (size_t d = 0; d < want_fb.logprobs.size(); ++d) {
    for (size_t p = 0; p < want_fb.logprobs[d].size(); ++p) {
      EXPECT_NEAR(fb->logprobs[d][p], want_fb.logprobs[d][p], 1e-6 * std::abs(want_fb.logprobs[d][p])) << d << " " << p;
    }
  }
  absl::StatusOr<OptimStepResult> step_b = absl::UnknownError("");
  {
    std::thread ta([&] { fa = together->Forward("a", batch_a); });
    std::thread tb([&] { step_b = together->TrainStep("b", batch_b, ppo, adam, nullptr, 0); });
    ta.join();
    tb.join();
  }
  ASSERT_OK(fa.status());
  ASSERT_OK(step_b.status());
  ASSERT_OK_AND_ASSIGN(OptimStepResult want_step_b, fresh->TrainStep("b", batch_b, ppo, adam, nullptr, 0));
  EXPECT_NEAR(step_b->metrics.Get("loss:sum"), want_step_b.metrics.Get("loss:sum"),
              1e-6 * std::abs(want_step_b.metrics.Get("loss:sum")));
  EXPECT_TRUE(fa->metrics.Has("time_coschedule_wait_s:sum"));

  // ForwardBackward calls join too; each run's OptimStep then steps its own gradients.
  absl::StatusOr<ForwardBackwardResult> fba = absl::UnknownError(""), fbb = absl::UnknownError("");
  {
    std::thread ta([&] { fba = together->ForwardBackward("a", batch_a, ppo, nullptr, std::nullopt); });
    std::thread tb([&] { fbb = together->ForwardBackward("b", batch_b, ppo, nullptr, std::nullopt); });
    ta.join();
    tb.join();
  }
  ASSERT_OK(fba.status());
  ASSERT_OK(fbb.status());
  EXPECT_EQ(fbb->metrics.Get("co_scheduled_runs:max"), 2.0);
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult want_fbb, fresh->ForwardBackward("b", batch_b, ppo, nullptr, std::nullopt));
  EXPECT_NEAR(fbb->metrics.Get("loss:sum"), want_fbb.metrics.Get("loss:sum"),
              1e-6 * std::abs(want_fbb.metrics.Get("loss:sum")));
  ASSERT_OK_AND_ASSIGN(OptimStepResult opt_b, together->OptimStep("b", adam));
  ASSERT_OK_AND_ASSIGN(OptimStepResult want_opt_b, fresh->OptimStep("b", adam));
  EXPECT_NEAR(opt_b.metrics.Get("grad_norm:sum"), want_opt_b.metrics.Get("grad_norm:sum"),
              1e-6 * want_opt_b.metrics.Get("grad_norm:sum"));
  ASSERT_OK(together->OptimStep("a", adam).status());
}

}  // namespace
}  // namespace lorastep
