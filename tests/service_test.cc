// End-to-end tests of the service with real processes on 127.0.0.1: a lorastep_coordinator
// that spawns its local lorastep_worker, driven through the C++ client. No mocks.
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

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(ScratchDir("service"));
    ModelConfig c = ModelConfigPreset("tiny").value();
    ASSERT_OK(SaveModel(*dir_ + "/model", c, RandomModelWeights(c, 1)));
    // Plain paths: this suite checks their rules (the default is a state store).
    auto server = ChildServer::Start(Binary("server/lorastep_coordinator"),
                                     {"--model", *dir_ + "/model", "--worker_binary",
                                      Binary("worker/lorastep_worker"), "--allow_plain_paths"},
                                     120);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new ChildServer(std::move(server).value());
    auto client = TrainerClient::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = client->release();
  }
  static void TearDownTestSuite() {
    delete client_;
    delete server_;  // SIGTERM: the coordinator stops its worker
  }
  RunSession NewRun(uint64_t seed = 7, double dropout = 0.0) {
    auto run = RunSession::Create(client_, Lora(dropout), seed);
    EXPECT_TRUE(run.ok()) << run.status();
    return std::move(run).value();
  }
  // The same run (LoRA r4, alpha 8, `seed`) built through lib/ directly, in this process.
  static std::unique_ptr<Trainer> LibTwin(uint64_t seed) {
    auto base = LoadBaseModel(*dir_ + "/model", "cpu", "");
    EXPECT_TRUE(base.ok()) << base.status();
    TrainerOptions options;
    options.lora.rank = 4;
    options.lora.alpha = 8;
    options.seed = seed;
    auto trainer = base.ok() ? Trainer::Create(*base, options) : absl::StatusOr<std::unique_ptr<Trainer>>(base.status());
    EXPECT_TRUE(trainer.ok()) << trainer.status();
    return trainer.ok() ? std::move(trainer).value() : nullptr;
  }

  static std::string* dir_;
  static ChildServer* server_;
  static TrainerClient* client_;
};
std::string* ServiceTest::dir_ = nullptr;
ChildServer* ServiceTest::server_ = nullptr;
TrainerClient* ServiceTest::client_ = nullptr;

TEST_F(ServiceTest, HealthAndRunRegistry) {
  ASSERT_OK_AND_ASSIGN(bool healthy, client_->Healthy());
  EXPECT_TRUE(healthy);
  RunSession run = NewRun();
  ASSERT_OK_AND_ASSIGN(v1::Run got, client_->GetRun(run.run_id()));
  EXPECT_EQ(got.lora().rank(), 4);
  EXPECT_EQ(got.next_sequence_id(), 1);
  EXPECT_EQ(got.base_model(), *dir_ + "/model");
  EXPECT_GT(got.created_unix_ms(), 0);
  EXPECT_EQ(got.last_step(), -1);
  EXPECT_EQ(got.last_step_unix_ms(), 0);
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK_AND_ASSIGN(v1::ListRunsResponse list, client_->ListRuns());
  bool found = false;
  for (const auto& r : list.runs()) {
    if (r.run_id() != run.run_id()) continue;
    found = true;
    EXPECT_EQ(r.learner_version(), 1);
    EXPECT_EQ(r.last_step(), 0);
    EXPECT_GE(r.last_step_unix_ms(), got.created_unix_ms());
    EXPECT_TRUE(r.diverged().empty());
  }
  EXPECT_TRUE(found);
}

TEST_F(ServiceTest, TrainStepOverGrpcEqualsLibDirectly) {
  RunSession run = NewRun(/*seed=*/21);
  std::unique_ptr<Trainer> local = LibTwin(21);
  ASSERT_NE(local, nullptr);
  LossConfig loss;
  loss.kind = LossKind::kPpo;
  ASSERT_OK_AND_ASSIGN(AdamWParams adam, AdamWParamsFromProto(Adam()));
  for (int step = 0; step < 3; ++step) {
    std::vector<v1::Datum> batch = Batch(step);
    ASSERT_OK_AND_ASSIGN(v1::StepResponse remote, run.TrainStep(batch, Ppo(), Adam()));
    google::protobuf::RepeatedPtrField<v1::Datum> batch_proto(batch.begin(), batch.end());
    std::vector<Datum> datums = DatumsFromProto(batch_proto);
    ASSERT_OK_AND_ASSIGN(OptimStepResult direct, local->TrainStep(datums, loss, adam));
    EXPECT_EQ(remote.adapter_sha256(), direct.adapter_sha256) << step;
    EXPECT_EQ(remote.learner_version(), direct.learner_version);
    for (const char* m : {"loss:sum", "pg_loss:sum", "grad_norm:sum", "pg_clipfrac:mean",
                          "ppo_kl:mean", "entropy:mean", "tokens_loss:sum", "tokens_physical:sum"}) {
      ASSERT_TRUE(remote.metrics().count(m)) << m;
      EXPECT_DOUBLE_EQ(remote.metrics().at(m), direct.metrics.Get(m)) << m;
    }
  }
}

// DRO (Tinker's loss, summed) with its beta reaches the trainer as sent: one step over gRPC
// equals the library's, adapter and metrics.
TEST_F(ServiceTest, DroStepOverGrpcEqualsLibDirectly) {
  RunSession run = NewRun(/*seed=*/23);
  std::unique_ptr<Trainer> local = LibTwin(23);
  ASSERT_NE(local, nullptr);
  LossConfig loss;
  loss.kind = LossKind::kDro;
  loss.dro_beta = 0.3;
  loss.normalization = LossNormalization::kSum;
  ASSERT_OK_AND_ASSIGN(AdamWParams adam, AdamWParamsFromProto(Adam()));
  v1::LossConfig dro;
  dro.set_loss_fn("dro");
  dro.set_dro_beta(0.3);
  dro.set_normalization("sum");
  std::vector<v1::Datum> batch = Batch(0);
  ASSERT_OK_AND_ASSIGN(v1::StepResponse remote, run.TrainStep(batch, dro, Adam()));
  google::protobuf::RepeatedPtrField<v1::Datum> batch_proto(batch.begin(), batch.end());
  ASSERT_OK_AND_ASSIGN(OptimStepResult direct, local->TrainStep(DatumsFromProto(batch_proto), loss, adam));
  EXPECT_EQ(remote.adapter_sha256(), direct.adapter_sha256);
  for (const char* m : {"loss:sum", "pg_loss:sum", "dro_penalty:mean", "grad_norm:sum"}) {
    ASSERT_TRUE(remote.metrics().count(m)) << m;
    EXPECT_DOUBLE_EQ(remote.metrics().at(m), direct.metrics.Get(m)) << m;
  }
}

// Packed datums (the client's default) and repeated Datum messages train bitwise alike,
// including a batch the packed form cannot carry (weights on one datum only: the client and
// the coordinator's worker call fall back to datums), and Forward gives the same log-probs.
// A token id past int32 is not narrowed into a valid one: it is sent as datums and refused.
TEST_F(ServiceTest, PackedAndRepeatedDatumsTrainAlike) {
  RunSession packed = NewRun(/*seed=*/31);
  RunSession repeated = NewRun(/*seed=*/31);
  repeated.pack_datums = false;
  for (int step = 0; step < 3; ++step) {
    std::vector<v1::Datum> batch = Batch(step);
    if (step == 1) {
      for (int i = 0; i < batch[0].tokens_size(); ++i) batch[0].add_weights(i % 2);
      v1::PackedDatums unused;
      EXPECT_FALSE(PackDatums(batch, &unused));
      EXPECT_EQ(unused.ByteSizeLong(), 0u);
    }
    if (step == 2) {  // next-token targets: sent as one last target per datum
      for (auto& d : batch) {
        for (int i = 0; i + 1 < d.tokens_size(); ++i) d.set_target_tokens(i, d.tokens(i + 1));
      }
      v1::PackedDatums form;
      ASSERT_TRUE(PackDatums(batch, &form));
      EXPECT_TRUE(form.target_tokens().empty());
      EXPECT_EQ(form.last_target_tokens().size(), 4 * batch.size());
    }
    ASSERT_OK_AND_ASSIGN(v1::StepResponse a, packed.TrainStep(batch, Ppo(), Adam()));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse b, repeated.TrainStep(batch, Ppo(), Adam()));
    EXPECT_EQ(a.adapter_sha256(), b.adapter_sha256()) << step;
    EXPECT_EQ(a.metrics().at("loss:sum"), b.metrics().at("loss:sum")) << step;
  }
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fa, packed.Forward(Batch(5)));
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fb, repeated.Forward(Batch(5)));
  ASSERT_EQ(fa.logprobs_size(), 4);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(fa.logprobs(i).values_size(), Batch(5)[i].tokens_size());
    for (int j = 0; j < fa.logprobs(i).values_size(); ++j) EXPECT_EQ(fa.logprobs(i).values(j), fb.logprobs(i).values(j));
  }
  std::vector<v1::Datum> wide = Batch(0);
  wide[0].set_tokens(0, (int64_t{1} << 32) + 5);  // id 5 if narrowed to int32
  v1::PackedDatums unused;
  EXPECT_FALSE(PackDatums(wide, &unused));
  EXPECT_THAT(packed.TrainStep(wide, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]: id 4294967301 outside"));
}

// A batch sent as k ForwardBackward calls (each with the whole batch's totals) followed by
// OptimStep equals one TrainStep on the whole batch, for every normalization. Without the
// totals, token and sequence normalization divide each part by its own counts (issue 10's
// defect: twice the gradient norm for two parts).
TEST_F(ServiceTest, ForwardBackwardCallsPlusOptimStepEqualOneTrainStep) {
  std::vector<v1::Datum> batch;
  for (int i = 0; i < 4; ++i) batch.push_back(MakeDatum(i, 0, 8, 96));  // equal lengths
  v1::BatchTotals totals;
  for (const auto& d : batch) {
    int bearing = 0;
    for (float a : d.advantages()) bearing += a != 0;
    totals.set_loss_tokens(totals.loss_tokens() + bearing);
    totals.set_samples(totals.samples() + (bearing > 0));
  }
  for (const char* normalization : {"sum", "token", "sequence"}) {
    SCOPED_TRACE(normalization);
    RunSession whole = NewRun(3), parts = NewRun(3), naive = NewRun(3);
    v1::LossConfig loss = Ppo();
    loss.set_normalization(normalization);
    // 16 padded tokens per micro-batch: TrainStep runs [d0,d1] then [d2,d3], like the calls.
    ASSERT_OK_AND_ASSIGN(v1::StepResponse a, whole.TrainStep(batch, loss, Adam(), 16));
    ASSERT_OK(parts.ForwardBackward({batch[0], batch[1]}, loss, &totals));
    ASSERT_OK_AND_ASSIGN(v1::Run mid, client_->GetRun(parts.run_id()));
    EXPECT_EQ(mid.pending_forward_backward(), 1);
    ASSERT_OK(parts.ForwardBackward({batch[2], batch[3]}, loss, &totals));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse b, parts.OptimStep(Adam()));
    EXPECT_EQ(a.adapter_sha256(), b.adapter_sha256());
    EXPECT_EQ(b.learner_version(), 1);
    EXPECT_DOUBLE_EQ(a.metrics().at("grad_norm:sum"), b.metrics().at("grad_norm:sum"));
    ASSERT_OK(naive.ForwardBackward({batch[0], batch[1]}, loss));
    ASSERT_OK(naive.ForwardBackward({batch[2], batch[3]}, loss));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse c, naive.OptimStep(Adam()));
    if (std::string(normalization) == "sum") {
      EXPECT_EQ(a.adapter_sha256(), c.adapter_sha256());
    } else {
      EXPECT_NEAR(c.metrics().at("grad_norm:sum") / a.metrics().at("grad_norm:sum"), 2.0, 1e-3);
    }
  }
  // Totals smaller than the call's own counts cannot be the whole batch's.
  RunSession bad = NewRun(3);
  v1::BatchTotals small = totals;
  small.set_loss_tokens(1);
  EXPECT_THAT(bad.ForwardBackward(batch, Ppo(), &small),
              StatusIs(absl::StatusCode::kInvalidArgument, "batch_totals.loss_tokens: 1 must be finite and at least"));
  small = totals;
  small.set_samples(std::nan(""));
  EXPECT_THAT(bad.ForwardBackward(batch, Ppo(), &small), StatusIs(absl::StatusCode::kInvalidArgument, "batch_totals.samples"));
  ASSERT_OK_AND_ASSIGN(v1::Run untouched, client_->GetRun(bad.run_id()));
  EXPECT_EQ(untouched.pending_forward_backward(), 0);
}

// Issue 10: a run can start from a PEFT adapter or a saved state, with or without the
// optimizer; a mismatch (rank, alpha, targets) is INVALID_ARGUMENT naming the field and no
// run is created.
TEST_F(ServiceTest, CreateRunFromAnAdapterOrACheckpoint) {
  RunSession source = NewRun(5);
  ASSERT_OK(source.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK(source.TrainStep(Batch(1), Ppo(), Adam()).status());
  const std::string dir = *dir_ + "/init";
  v1::SaveStateRequest save;
  save.set_run_id(source.run_id());
  save.set_path(dir + "/ck");
  ASSERT_OK(client_->SaveState(save).status());
  auto export_sha = [&](const std::string& run_id, const std::string& path) -> std::string {
    v1::ExportAdapterRequest exp;
    exp.set_run_id(run_id);
    exp.set_path(path);
    auto r = client_->ExportAdapter(exp);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->adapter_sha256() : "";
  };
  const std::string source_sha = export_sha(source.run_id(), dir + "/peft");
  int created = 0;
  auto create = [&](const std::string& from, bool with_optimizer, v1::LoraConfig lora) {
    v1::CreateRunRequest req;
    req.set_request_id(absl::StrCat("init-", created++));
    *req.mutable_lora() = lora;
    req.set_seed(9);
    req.set_init_from(from);
    req.set_init_with_optimizer(with_optimizer);
    return client_->CreateRun(req);
  };
  ASSERT_OK_AND_ASSIGN(v1::ListRunsResponse before, client_->ListRuns());
  v1::LoraConfig wrong_rank = Lora();
  wrong_rank.set_rank(8);
  EXPECT_THAT(create(dir + "/peft", false, wrong_rank), StatusIs(absl::StatusCode::kInvalidArgument, "init_from: adapter_config.json: r:"));
  v1::LoraConfig wrong_alpha = Lora();
  wrong_alpha.set_alpha(16);
  EXPECT_THAT(create(dir + "/peft", false, wrong_alpha), StatusIs(absl::StatusCode::kInvalidArgument, "lora_alpha"));
  EXPECT_THAT(create(dir + "/ck", false, wrong_rank), StatusIs(absl::StatusCode::kInvalidArgument, "init_from"));
  EXPECT_THAT(create(dir + "/peft", true, Lora()), StatusIs(absl::StatusCode::kInvalidArgument, "init_with_optimizer"));
  EXPECT_THAT(create(dir + "/nothing", false, Lora()), StatusIs(absl::StatusCode::kNotFound, "init_from"));
  v1::LoraConfig fewer_targets = Lora();
  fewer_targets.add_target_modules("q_proj");
  EXPECT_THAT(create(dir + "/peft", false, fewer_targets),
              StatusIs(absl::StatusCode::kInvalidArgument, "target_modules"));
  // rsLoRA and DoRA adapters would load as plain LoRA and change the model: refused.
  ASSERT_OK_AND_ASSIGN(std::string config, ReadFileToString(dir + "/peft/adapter_config.json"));
  for (const std::string variant : {"use_rslora", "use_dora"}) {
    const std::string folder = dir + "/peft_" + variant;
    ASSERT_OK(MakeDirectories(folder));
    ASSERT_OK_AND_ASSIGN(std::string tensors, ReadFileToString(dir + "/peft/adapter_model.safetensors"));
    ASSERT_OK(WriteStringToFile(folder + "/adapter_model.safetensors", tensors));
    std::string edited = config;
    const std::string off = "\"" + variant + "\": false";
    ASSERT_NE(edited.find(off), std::string::npos);
    edited.replace(edited.find(off), off.size(), "\"" + variant + "\": true");
    ASSERT_OK(WriteStringToFile(folder + "/adapter_config.json", edited));
    EXPECT_THAT(create(folder, false, Lora()), StatusIs(absl::StatusCode::kInvalidArgument, variant)) << variant;
  }
  ASSERT_OK_AND_ASSIGN(v1::ListRunsResponse after, client_->ListRuns());
  EXPECT_EQ(after.runs_size(), before.runs_size());  // failed creations leave nothing

  ASSERT_OK_AND_ASSIGN(v1::Run from_peft, create(dir + "/peft", false, Lora()));
  EXPECT_EQ(from_peft.learner_version(), 0);
  EXPECT_EQ(export_sha(from_peft.run_id(), dir + "/peft2"), source_sha);
  ASSERT_OK_AND_ASSIGN(v1::Run weights_only, create(dir + "/ck", false, Lora()));
  EXPECT_EQ(weights_only.learner_version(), 0);
  EXPECT_EQ(export_sha(weights_only.run_id(), dir + "/peft3"), source_sha);
  ASSERT_OK_AND_ASSIGN(v1::Run resumed, create(dir + "/ck", true, Lora()));
  EXPECT_EQ(resumed.learner_version(), 2);
  // With its optimizer state the new run continues exactly as the source does.
  ASSERT_OK_AND_ASSIGN(RunSession resumed_session, RunSession::Attach(client_, resumed.run_id()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse a, resumed_session.TrainStep(Batch(2), Ppo(), Adam()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse b, source.TrainStep(Batch(2), Ppo(), Adam()));
  EXPECT_EQ(a.adapter_sha256(), b.adapter_sha256());
  EXPECT_EQ(a.learner_version(), 3);
  // The imported values survive a step (the optimizer's master copy took them).
  ASSERT_OK_AND_ASSIGN(RunSession peft_session, RunSession::Attach(client_, from_peft.run_id()));
  ASSERT_OK(peft_session.TrainStep(Batch(2), Ppo(), Adam()).status());
  ASSERT_OK_AND_ASSIGN(RunSession weights_session, RunSession::Attach(client_, weights_only.run_id()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse w, weights_session.TrainStep(Batch(2), Ppo(), Adam()));
  EXPECT_EQ(w.learner_version(), 1);
}

// Tinker's train_attn / train_mlp / train_unembed: the run echoes the resolved targets, the
// LM head's LoRA trains (its B moves away from 0), and the PEFT export carries it under
// PEFT's lm_head keys; a run from that export reproduces the adapter.
TEST_F(ServiceTest, TrainSwitchesSelectTargetsAndTheHeadLoraTrainsAndExports) {
  v1::LoraConfig lora = Lora();
  lora.set_train_attn(false);  // unset train_mlp and train_unembed are true, as in Tinker
  v1::CreateRunRequest req;
  req.set_request_id("switches");
  *req.mutable_lora() = lora;
  req.set_seed(4);
  ASSERT_OK_AND_ASSIGN(v1::Run created, client_->CreateRun(req));
  EXPECT_THAT(std::vector<std::string>(created.lora().target_modules().begin(), created.lora().target_modules().end()),
              ::testing::ElementsAre("gate_proj", "up_proj", "down_proj", "lm_head"));
  EXPECT_FALSE(created.lora().has_train_unembed());
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Attach(client_, created.run_id()));
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK(run.TrainStep(Batch(1), Ppo(), Adam()).status());
  const std::string folder = *dir_ + "/peft-switches";
  v1::ExportAdapterRequest exp;
  exp.set_run_id(run.run_id());
  exp.set_path(folder);
  ASSERT_OK_AND_ASSIGN(v1::ExportAdapterResponse exported, client_->ExportAdapter(exp));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(folder + "/adapter_model.safetensors"));
  EXPECT_EQ(f.entries().size(), 2u * 3 * 2 + 2);  // 2 layers x 3 MLP linears x (A, B) + the head's
  ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* head_b, f.Find("base_model.model.lm_head.lora_B.weight"));
  ASSERT_OK_AND_ASSIGN(at::Tensor b, TensorFromEntry(*head_b));
  EXPECT_GT(b.abs().max().item<double>(), 0.0);  // trained: it starts at 0
  EXPECT_TRUE(f.Find("base_model.model.lm_head.lora_A.weight").ok());
  EXPECT_FALSE(f.Find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").ok());
  ASSERT_OK_AND_ASSIGN(std::string config, ReadFileToString(folder + "/adapter_config.json"));
  EXPECT_NE(config.find("\"lm_head\""), std::string::npos) << config;
  // A run created from the export with the same switches holds the same adapter.
  v1::CreateRunRequest again = req;
  again.set_request_id("switches-again");
  again.set_init_from(folder);
  ASSERT_OK_AND_ASSIGN(v1::Run copy, client_->CreateRun(again));
  v1::ExportAdapterRequest exp2;
  exp2.set_run_id(copy.run_id());
  exp2.set_path(folder + "-copy");
  ASSERT_OK_AND_ASSIGN(v1::ExportAdapterResponse exported2, client_->ExportAdapter(exp2));
  EXPECT_EQ(exported2.adapter_sha256(), exported.adapter_sha256());
}

TEST_F(ServiceTest, RetriedRequestIdAppliesOnce) {
  RunSession run = NewRun();
  v1::TrainStepRequest req;
  req.set_run_id(run.run_id());
  req.set_request_id("retry-me");
  req.set_sequence_id(1);
  for (const auto& d : Batch(0)) *req.add_datums() = d;
  *req.mutable_loss() = Ppo();
  *req.mutable_adamw() = Adam();
  ASSERT_OK_AND_ASSIGN(v1::StepResponse first, client_->TrainStep(req));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse again, client_->TrainStep(req));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(first, again));
  EXPECT_EQ(first.adapter_sha256(), again.adapter_sha256());
  ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(run.run_id()));
  EXPECT_EQ(state.learner_version(), 1);
  EXPECT_EQ(state.next_sequence_id(), 2);
  v1::GetStepMetricsRequest mreq;
  mreq.set_run_id(run.run_id());
  ASSERT_OK_AND_ASSIGN(v1::GetStepMetricsResponse history, client_->GetStepMetrics(mreq));
  EXPECT_EQ(history.steps_size(), 1);
  // The same request_id for another call is refused.
  v1::OptimStepRequest opt;
  opt.set_run_id(run.run_id());
  opt.set_request_id("retry-me");
  opt.set_sequence_id(2);
  EXPECT_THAT(client_->OptimStep(opt), StatusIs(absl::StatusCode::kInvalidArgument, "request_id"));
  // A retried CreateRun returns the same run.
  v1::CreateRunRequest create;
  create.set_request_id("create-once");
  *create.mutable_lora() = Lora();
  ASSERT_OK_AND_ASSIGN(v1::Run r1, client_->CreateRun(create));
  ASSERT_OK_AND_ASSIGN(v1::Run r2, client_->CreateRun(create));
  EXPECT_EQ(r1.run_id(), r2.run_id());
  // The same request_id with a different payload is refused, not answered with the old
  // response: a different batch for the TrainStep, a different config for the CreateRun.
  v1::TrainStepRequest other = req;
  other.mutable_datums(0)->set_advantages(0, 0.25f);
  EXPECT_THAT(client_->TrainStep(other), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  "'retry-me' was already used for a different TrainStep"));
  v1::CreateRunRequest changed = create;
  changed.mutable_lora()->set_rank(create.lora().rank() + 1);
  EXPECT_THAT(client_->CreateRun(changed), StatusIs(absl::StatusCode::kInvalidArgument,
                                                    "already created run '" + r1.run_id() + "' from a different CreateRun"));
  // Packed datums: the coordinator leaves them where gRPC holds them and hashes them in their
  // place, so the same request matches its record whether the batch came after the other
  // fields (the C++ client's raw call) or in field order (a whole serialized message).
  v1::TrainStepRequest packed_req = req;
  packed_req.clear_datums();
  packed_req.set_request_id("retry-packed");
  packed_req.set_sequence_id(2);
  packed_req.set_activation_recompute("none");  // a field numbered after packed_datums
  v1::PackedDatums packed;
  ASSERT_TRUE(PackDatums(Batch(1), &packed));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse raw, client_->TrainStep(packed_req, packed));
  v1::TrainStepRequest whole = packed_req;
  *whole.mutable_packed_datums() = packed;
  ASSERT_OK_AND_ASSIGN(v1::StepResponse replayed, client_->TrainStep(whole));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(raw, replayed));
  v1::PackedDatums changed_batch = packed;
  changed_batch.mutable_advantages()->back() ^= 1;
  EXPECT_THAT(client_->TrainStep(packed_req, changed_batch),
              StatusIs(absl::StatusCode::kInvalidArgument, "'retry-packed' was already used for a different TrainStep"));
  ASSERT_OK_AND_ASSIGN(v1::Run after, client_->GetRun(run.run_id()));
  EXPECT_EQ(after.learner_version(), 2);
}

TEST_F(ServiceTest, OutOfOrderSequenceIdsAreRefused) {
  RunSession run = NewRun();
  v1::ForwardBackwardRequest req;
  req.set_run_id(run.run_id());
  req.set_request_id("fb-1");
  req.set_sequence_id(2);  // next is 1
  for (const auto& d : Batch(0)) *req.add_datums() = d;
  *req.mutable_loss() = Ppo();
  EXPECT_THAT(client_->ForwardBackward(req),
              StatusIs(absl::StatusCode::kFailedPrecondition, "sequence_id: expected 1, got 2"));
  req.set_sequence_id(0);
  EXPECT_THAT(client_->ForwardBackward(req), StatusIs(absl::StatusCode::kFailedPrecondition, "sequence_id"));
  req.set_sequence_id(1);
  ASSERT_OK(client_->ForwardBackward(req));
  req.set_request_id("fb-2");  // a new call reusing the consumed id
  EXPECT_THAT(client_->ForwardBackward(req), StatusIs(absl::StatusCode::kFailedPrecondition, "expected 2"));
}

// A TrainStep of `run_id` under `request_id` and sequence id `seq`: `datums` datums of
// `length` tokens (PPO, the suite's AdamW).
v1::TrainStepRequest SequencedStep(const std::string& run_id, const std::string& request_id, int64_t seq, int datums,
                                   int length) {
  v1::TrainStepRequest req;
  req.set_run_id(run_id);
  req.set_request_id(request_id);
  req.set_sequence_id(seq);
  for (int i = 0; i < datums; ++i) *req.add_datums() = MakeDatum(i, int(seq), length, 96);
  *req.mutable_loss() = Ppo();
  *req.mutable_adamw() = Adam();
  return req;
}

// One call per sequence id at a time: of two calls sent together with one sequence id under
// different request_ids, the one received first takes it and applies; the other, arriving
// while the first is queued or running, is refused at once naming the first (not queued
// behind it to be refused later). Once the first is answered the id is consumed.
TEST_F(ServiceTest, ASecondCallWithAQueuedSequenceIdIsRefusedAtOnce) {
  RunSession run = NewRun();
  auto step = [&](const std::string& request_id, int64_t seq, int datums, int length) {
    return SequencedStep(run.run_id(), request_id, seq, datums, length);
  };
  bool caught = false;
  for (int64_t seq = 1; seq <= 10 && !caught; ++seq) {
    // A long call and a short one together; which arrives first is the transport's choice.
    const v1::TrainStepRequest slow = step(absl::StrCat("slow-", seq), seq, 16, 256), quick = step(absl::StrCat("quick-", seq), seq, 4, 8);
    absl::StatusOr<v1::StepResponse> a, b;
    std::thread sender([&] { a = client_->TrainStep(slow); });
    b = client_->TrainStep(quick);
    sender.join();
    ASSERT_NE(a.ok(), b.ok()) << a.status() << " / " << b.status();
    const absl::Status& loser = a.ok() ? b.status() : a.status();
    const std::string winner = a.ok() ? slow.request_id() : quick.request_id();
    if (absl::StrContains(loser.message(), "expected")) continue;  // the winner was answered first: again
    EXPECT_THAT(loser, StatusIs(absl::StatusCode::kFailedPrecondition,
                                absl::StrCat("sequence_id: ", seq, " is taken by a call queued before this one (request_id '",
                                             winner, "')")));
    caught = true;
    ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(run.run_id()));
    EXPECT_EQ(state.learner_version(), seq);
    EXPECT_EQ(state.next_sequence_id(), seq + 1);
    // Consumed: the loser sent again is refused as any late call is.
    EXPECT_THAT(client_->TrainStep(a.ok() ? quick : slow),
                StatusIs(absl::StatusCode::kFailedPrecondition, absl::StrCat("expected ", seq + 1)));
  }
  EXPECT_TRUE(caught) << "in 10 tries the second call never arrived while the first was queued or running";
}

// A call that cannot be next when its turn comes is refused when it arrives, not after a wait
// behind the calls queued before it: an id already consumed under a new request_id, and one
// past the next with nothing queued before it. Each is answered while a long step (the probe
// shows it holds the next id) is still running.
TEST_F(ServiceTest, CallsThatCannotBeNextAreRefusedWithoutWaitingInTheQueue) {
  RunSession run = NewRun();
  auto step = [&](const std::string& request_id, int64_t seq, int datums, int length) {
    return SequencedStep(run.run_id(), request_id, seq, datums, length);
  };
  bool caught = false;
  int64_t seq = 1;  // the run's next id
  for (int attempt = 0; attempt < 10 && !caught; ++attempt) {
    std::atomic<bool> slow_answered{false};
    absl::StatusOr<v1::StepResponse> slow;
    std::thread sender([&] {
      slow = client_->TrainStep(step(absl::StrCat("slow-", attempt), seq, 32, 256));
      slow_answered = true;
    });
    // Once a second call with the same id is refused as taken, the long one holds it. The
    // probe's batch is invalid: one that takes the id first is refused in its turn and
    // consumes nothing.
    v1::TrainStepRequest probe_req = step(absl::StrCat("probe-", attempt), seq, 1, 8);
    probe_req.mutable_datums(0)->set_advantages(0, NAN);
    absl::Status probe;
    do {
      probe = client_->TrainStep(probe_req).status();
    } while (!slow_answered && !absl::StrContains(probe.message(), "is taken"));
    const absl::Status stale = client_->TrainStep(step(absl::StrCat("stale-", attempt), seq - 1, 1, 8)).status();
    const absl::Status early = client_->TrainStep(step(absl::StrCat("early-", attempt), seq + 2, 1, 8)).status();
    const bool before_slow = !slow_answered;
    sender.join();
    if (!slow.ok() && absl::StrContains(slow.status().message(), "is taken")) continue;  // the probe was first
    ASSERT_OK(slow.status());
    ++seq;
    EXPECT_THAT(stale, StatusIs(absl::StatusCode::kFailedPrecondition, absl::StrCat("got ", seq - 2)));
    EXPECT_THAT(early, StatusIs(absl::StatusCode::kFailedPrecondition, absl::StrCat("got ", seq + 1)));
    caught = before_slow && absl::StrContains(probe.message(), "is taken");
  }
  EXPECT_TRUE(caught) << "in 10 tries the refusals never came while the long step was running";
  ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(run.run_id()));
  EXPECT_EQ(state.learner_version(), state.next_sequence_id() - 1);  // only the long steps applied
}

TEST_F(ServiceTest, InterleavedRunsOnOneWorkerEachEqualThatRunAlone) {
  RunSession a = NewRun(11, 0.1), b = NewRun(12, 0.1), alone = NewRun(11, 0.1);
  std::string a_sha, alone_sha;
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK_AND_ASSIGN(v1::StepResponse ra, a.TrainStep(Batch(step), Ppo(), Adam()));
    ASSERT_OK(b.TrainStep(Batch(step + 10), Ppo(), Adam()));
    a_sha = ra.adapter_sha256();
  }
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK_AND_ASSIGN(v1::StepResponse r, alone.TrainStep(Batch(step), Ppo(), Adam()));
    alone_sha = r.adapter_sha256();
  }
  EXPECT_EQ(a_sha, alone_sha);
}

TEST_F(ServiceTest, BadCallBetweenGoodCallsChangesNothing) {
  RunSession probed = NewRun(5, 0.1), clean = NewRun(5, 0.1);
  ASSERT_OK(probed.TrainStep(Batch(0), Ppo(), Adam()));
  ASSERT_OK(clean.TrainStep(Batch(0), Ppo(), Adam()));
  std::vector<v1::Datum> bad = Batch(1);
  bad[1].set_advantages(3, NAN);
  EXPECT_THAT(probed.TrainStep(bad, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[1].advantages[3]: not finite"));
  std::vector<v1::Datum> overflow = Batch(1);  // a gradient that would overflow: refused by name
  for (auto& d : overflow)
    for (int i = 0; i < d.advantages_size(); ++i)
      if (d.advantages(i) != 0) d.set_advantages(i, 3e38f);
  v1::LossConfig unnormalized = Ppo();  // sum: no 1/tokens to pull the gradient back into range
  unnormalized.set_normalization("sum");
  EXPECT_THAT(probed.TrainStep(overflow, unnormalized, Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "has magnitude over"));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse p, probed.TrainStep(Batch(1), Ppo(), Adam()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse c, clean.TrainStep(Batch(1), Ppo(), Adam()));
  EXPECT_EQ(p.adapter_sha256(), c.adapter_sha256());
  EXPECT_EQ(p.learner_version(), 2);
  ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(probed.run_id()));
  EXPECT_EQ(state.next_sequence_id(), 3);  // the failed calls consumed no sequence id
}

// With --allow_plain_paths (no state store), references are refused and the store's calls
// say why.
TEST_F(ServiceTest, StateStoreCallsNeedAStateDir) {
  RunSession run = NewRun();
  v1::SaveStateRequest req;
  req.set_run_id(run.run_id());
  req.set_path("lorastep://" + run.run_id() + "/x");
  EXPECT_THAT(client_->SaveState(req), StatusIs(absl::StatusCode::kInvalidArgument, "--allow_plain_paths"));
  v1::ListCheckpointsRequest list;
  list.set_run_id(run.run_id());
  EXPECT_THAT(client_->ListCheckpoints(list), StatusIs(absl::StatusCode::kFailedPrecondition, "--allow_plain_paths"));
}

// Bad TrainStep requests and the message each must be refused with (INVALID_ARGUMENT).
struct ValidationCase {
  const char* what;
  std::function<void(v1::TrainStepRequest*)> mutate;
  const char* message;
};

std::vector<ValidationCase> ValidationCases() {
  return {
      {"token out of vocab", [](auto* r) { r->mutable_datums(2)->set_tokens(1, 96); },
       "datums[2].tokens[1]: id 96 outside [0, 96)"},
      {"negative target", [](auto* r) { r->mutable_datums(0)->set_target_tokens(0, -1); },
       "datums[0].target_tokens[0]"},
      {"length mismatch", [](auto* r) { r->mutable_datums(1)->mutable_target_tokens()->RemoveLast(); },
       "datums[1].target_tokens: length"},
      {"nan logprob", [](auto* r) { r->mutable_datums(3)->set_logprobs(0, NAN); },
       "datums[3].logprobs[0]: not finite"},
      {"inf advantage", [](auto* r) { r->mutable_datums(0)->set_advantages(4, INFINITY); },
       "datums[0].advantages[4]: not finite"},
      {"missing logprobs", [](auto* r) { r->mutable_datums(0)->clear_logprobs(); },
       "datums[0].logprobs: required"},
      {"negative weight", [](auto* r) {
         for (int i = 0; i < r->datums(0).tokens_size(); ++i) r->mutable_datums(0)->add_weights(1);
         r->mutable_datums(0)->set_weights(2, -1);
       }, "datums[0].weights[2]: negative"},
      {"empty batch", [](auto* r) { r->clear_datums(); }, "datums: empty batch"},
      {"empty datum", [](auto* r) {
         r->mutable_datums(0)->clear_tokens();
         r->mutable_datums(0)->clear_target_tokens();
       }, "datums[0].tokens: empty"},
      {"unknown loss", [](auto* r) { r->mutable_loss()->set_loss_fn("dpo"); }, "loss.loss_fn: unknown 'dpo'"},
      {"clip low", [](auto* r) { r->mutable_loss()->set_clip_eps_low(1.5); }, "loss.clip_eps_low"},
      {"dual clip", [](auto* r) { r->mutable_loss()->set_dual_clip_c(0.5); }, "loss.dual_clip_c"},
      {"kl estimator", [](auto* r) { r->mutable_loss()->set_kl_estimator("k9"); }, "loss.kl_estimator"},
      {"kl without ref", [](auto* r) { r->mutable_loss()->set_kl_coef(0.1); },
       "datums[0].ref_logprobs: required"},
      {"normalization", [](auto* r) { r->mutable_loss()->set_normalization("mean"); }, "loss.normalization"},
      {"tis cap", [](auto* r) { r->mutable_loss()->set_tis_cap(-1); }, "loss.tis_cap"},
      {"dro beta", [](auto* r) {
         r->mutable_loss()->set_loss_fn("dro");
         r->mutable_loss()->set_dro_beta(-0.5);
       }, "loss.dro_beta: must be in [0, "},
      {"beta2", [](auto* r) { r->mutable_adamw()->set_beta2(1.5); }, "adamw.beta2"},
      {"lr", [](auto* r) { r->mutable_adamw()->set_lr(-1); }, "adamw.lr"},
      {"schedule", [](auto* r) { r->mutable_adamw()->set_schedule("linear"); }, "adamw.schedule"},
      {"max tokens", [](auto* r) { r->set_max_tokens_per_microbatch(-5); }, "max_tokens_per_microbatch"},
      {"request id", [](auto* r) { r->clear_request_id(); }, "request_id: required"},
      // The packed form: its own shape errors name packed_datums; what it holds is checked
      // like datums (datum indices as in the equivalent datums).
      {"both forms", [](auto* r) { ASSERT_TRUE(ToPacked(r)); for (const auto& d : Batch(0)) *r->add_datums() = d; },
       "packed_datums: set together with datums"},
      {"packed short array", [](auto* r) { ASSERT_TRUE(ToPacked(r)); r->mutable_packed_datums()->mutable_logprobs()->resize(12); },
       "packed_datums.logprobs: 12 bytes; expected 4 per position"},
      {"packed tokens missing", [](auto* r) { ASSERT_TRUE(ToPacked(r)); r->mutable_packed_datums()->clear_tokens(); },
       "packed_datums.tokens: 0 bytes"},
      {"packed negative length", [](auto* r) { ASSERT_TRUE(ToPacked(r)); r->mutable_packed_datums()->set_lengths(1, -3); },
       "packed_datums.lengths[1]: -3 is negative"},
      {"packed both target forms", [](auto* r) { ASSERT_TRUE(ToPacked(r)); r->mutable_packed_datums()->set_last_target_tokens(std::string(16, '\0')); },
       "packed_datums.last_target_tokens: set together with target_tokens"},
      {"packed last targets size", [](auto* r) {
         ASSERT_TRUE(ToPacked(r));
         r->mutable_packed_datums()->clear_target_tokens();
         r->mutable_packed_datums()->set_last_target_tokens(std::string(12, '\0'));
       }, "packed_datums.last_target_tokens: 12 bytes; expected 4 per datum, 16 for the 4 datums in lengths"},
      {"packed last target out of vocab", [](auto* r) {
         ASSERT_TRUE(ToPacked(r));
         r->mutable_packed_datums()->clear_target_tokens();
         std::string last(16, '\0');
         const int32_t bad = 96;
         std::memcpy(&last[8], &bad, 4);
         r->mutable_packed_datums()->set_last_target_tokens(last);
       }, "datums[2].target_tokens[7]: id 96 outside [0, 96)"},
      {"packed token out of vocab", [](auto* r) { r->mutable_datums(2)->set_tokens(1, 96); ASSERT_TRUE(ToPacked(r)); },
       "datums[2].tokens[1]: id 96 outside [0, 96)"},
      {"packed missing logprobs", [](auto* r) { for (auto& d : *r->mutable_datums()) d.clear_logprobs(); ASSERT_TRUE(ToPacked(r)); },
       "datums[0].logprobs: required"},
  };
}

// A TrainStep request of Batch(0) on `run_id`, changed by `c`.
v1::TrainStepRequest BadTrainStep(const std::string& run_id, const ValidationCase& c) {
  v1::TrainStepRequest req;
  req.set_run_id(run_id);
  req.set_request_id(std::string("v-") + c.what);
  req.set_sequence_id(1);
  for (const auto& d : Batch(0)) *req.add_datums() = d;
  *req.mutable_loss() = Ppo();
  *req.mutable_adamw() = Adam();
  c.mutate(&req);
  return req;
}

// Issue 26, defect 8: every call that carries a request_id refuses an empty one (it could be
// neither recorded nor deduplicated), and nothing is applied.
TEST_F(ServiceTest, EveryCallWithARequestIdRefusesAnEmptyOne) {
  RunSession run = NewRun();
  v1::CreateRunRequest create;
  *create.mutable_lora() = Lora();
  EXPECT_THAT(client_->CreateRun(create), StatusIs(absl::StatusCode::kInvalidArgument, "request_id: required"));
  v1::ForwardBackwardRequest fb;
  fb.set_run_id(run.run_id());
  fb.set_sequence_id(1);
  for (const auto& d : Batch(0)) *fb.add_datums() = d;
  *fb.mutable_loss() = Ppo();
  EXPECT_THAT(client_->ForwardBackward(fb), StatusIs(absl::StatusCode::kInvalidArgument, "request_id: required"));
  v1::OptimStepRequest optim;
  optim.set_run_id(run.run_id());
  optim.set_sequence_id(1);
  *optim.mutable_adamw() = Adam();
  EXPECT_THAT(client_->OptimStep(optim), StatusIs(absl::StatusCode::kInvalidArgument, "request_id: required"));
  v1::LoadStateRequest load;
  load.set_run_id(run.run_id());
  load.set_sequence_id(1);
  load.set_path("lorastep://" + run.run_id() + "/absent");
  EXPECT_THAT(client_->LoadState(load), StatusIs(absl::StatusCode::kInvalidArgument, "request_id: required"));
  ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(run.run_id()));
  EXPECT_EQ(state.next_sequence_id(), 1);
  EXPECT_EQ(state.learner_version(), 0);
  EXPECT_EQ(state.pending_forward_backward(), 0);
}

TEST_F(ServiceTest, EveryValidationErrorNamesTheField) {
  RunSession run = NewRun();
  for (const ValidationCase& c : ValidationCases()) {
    EXPECT_THAT(client_->TrainStep(BadTrainStep(run.run_id(), c)), StatusIs(absl::StatusCode::kInvalidArgument, c.message))
        << c.what;
  }
  ASSERT_OK_AND_ASSIGN(v1::Run state, client_->GetRun(run.run_id()));
  EXPECT_EQ(state.next_sequence_id(), 1);
  EXPECT_EQ(state.learner_version(), 0);
  // The batch is converted as the call arrives, but its errors come in the same order as
  // before: an unknown run first, whatever the batch holds.
  for (const char* what : {"packed short array", "token out of vocab"}) {
    for (const ValidationCase& c : ValidationCases()) {
      if (std::string(c.what) != what) continue;
      v1::TrainStepRequest req = BadTrainStep("no-such-run", c);
      EXPECT_THAT(client_->TrainStep(req), StatusIs(absl::StatusCode::kNotFound, "no-such-run")) << what;
      v1::ForwardRequest fwd;
      fwd.set_run_id("no-such-run");
      *fwd.mutable_datums() = req.datums();
      *fwd.mutable_packed_datums() = req.packed_datums();
      EXPECT_THAT(client_->Forward(fwd), StatusIs(absl::StatusCode::kNotFound, "no-such-run")) << what;
    }
  }

  v1::CreateRunRequest create;
  create.set_request_id("bad-create");
  create.mutable_lora()->set_rank(-1);
  EXPECT_THAT(client_->CreateRun(create), StatusIs(absl::StatusCode::kInvalidArgument, "lora.rank"));
  create.mutable_lora()->set_rank(4);
  create.mutable_lora()->set_alpha(4);
  create.mutable_lora()->add_target_modules("mlp");
  EXPECT_THAT(client_->CreateRun(create),
              StatusIs(absl::StatusCode::kInvalidArgument, "lora.target_modules[0]: unknown module 'mlp'"));
  create.mutable_lora()->clear_target_modules();
  // Tinker's switches: not together with target_modules, and not all off.
  create.mutable_lora()->add_target_modules("q_proj");
  create.mutable_lora()->set_train_unembed(true);
  EXPECT_THAT(client_->CreateRun(create),
              StatusIs(absl::StatusCode::kInvalidArgument, "lora.target_modules: give either"));
  create.mutable_lora()->clear_target_modules();
  create.mutable_lora()->set_train_attn(false);
  create.mutable_lora()->set_train_mlp(false);
  create.mutable_lora()->set_train_unembed(false);
  EXPECT_THAT(client_->CreateRun(create),
              StatusIs(absl::StatusCode::kInvalidArgument, "lora.train_attn, lora.train_mlp, lora.train_unembed"));
  create.mutable_lora()->clear_train_attn();
  create.mutable_lora()->clear_train_mlp();
  create.mutable_lora()->clear_train_unembed();
  create.set_base_model("/elsewhere");
  EXPECT_THAT(client_->CreateRun(create), StatusIs(absl::StatusCode::kInvalidArgument, "base_model"));
  create.set_base_model("");
  create.clear_request_id();
  EXPECT_THAT(client_->CreateRun(create), StatusIs(absl::StatusCode::kInvalidArgument, "request_id"));
  EXPECT_THAT(client_->GetRun("nope"), StatusIs(absl::StatusCode::kNotFound, "run_id: no run 'nope'"));
  v1::SaveStateRequest save;
  save.set_run_id(run.run_id());
  EXPECT_THAT(client_->SaveState(save), StatusIs(absl::StatusCode::kInvalidArgument, "path: required"));
  v1::GetStepMetricsRequest metrics;
  metrics.set_run_id(run.run_id());
  metrics.set_limit(-1);
  EXPECT_THAT(client_->GetStepMetrics(metrics), StatusIs(absl::StatusCode::kInvalidArgument, "limit"));
  std::vector<v1::Datum> bad_forward = Batch(0);
  bad_forward[0].set_tokens(0, 1000);
  EXPECT_THAT(run.Forward(bad_forward), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  // A response the caller says it cannot receive is refused before any work.
  v1::ForwardRequest too_big;
  too_big.set_run_id(run.run_id());
  for (const auto& d : Batch(0)) *too_big.add_datums() = d;
  too_big.set_max_response_bytes(1000);
  EXPECT_THAT(client_->Forward(too_big), StatusIs(absl::StatusCode::kResourceExhausted, "max_response_bytes"));
  // The same bound when the batch comes packed (the spawned worker takes it as sent: the
  // coordinator counts its targets from the packed lengths).
  v1::ForwardRequest too_big_packed = too_big;
  ASSERT_TRUE(ToPacked(&too_big_packed));
  EXPECT_EQ(client_->Forward(too_big_packed).status(), client_->Forward(too_big).status());
  v1::ForwardBackwardRequest too_big_fb;
  too_big_fb.set_run_id(run.run_id());
  too_big_fb.set_request_id("too-big");
  too_big_fb.set_sequence_id(run.next_sequence_id());
  for (const auto& d : Batch(0)) *too_big_fb.add_datums() = d;
  *too_big_fb.mutable_loss() = Ppo();
  too_big_fb.set_max_response_bytes(1000);
  EXPECT_THAT(client_->ForwardBackward(too_big_fb), StatusIs(absl::StatusCode::kResourceExhausted, "max_response_bytes"));
  v1::ForwardBackwardRequest too_big_fb_packed = too_big_fb;
  ASSERT_TRUE(ToPacked(&too_big_fb_packed));
  EXPECT_EQ(client_->ForwardBackward(too_big_fb_packed).status(), client_->ForwardBackward(too_big_fb).status());
  too_big_fb.set_max_response_bytes(-1);
  EXPECT_THAT(client_->ForwardBackward(too_big_fb), StatusIs(absl::StatusCode::kInvalidArgument, "max_response_bytes"));
  ASSERT_OK_AND_ASSIGN(v1::Run unchanged, client_->GetRun(run.run_id()));
  EXPECT_EQ(unchanged.next_sequence_id(), run.next_sequence_id());
  EXPECT_EQ(unchanged.pending_forward_backward(), 0);
  v1::CreateRunRequest dup;
  dup.set_request_id("dup-id");
  dup.set_run_id(run.run_id());
  *dup.mutable_lora() = Lora();
  EXPECT_THAT(client_->CreateRun(dup), StatusIs(absl::StatusCode::kAlreadyExists, "exists"));
}

TEST_F(ServiceTest, SaveLoadExportAndMetricsThroughTheApi) {
  RunSession run = NewRun(9);
  ASSERT_OK_AND_ASSIGN(v1::StepResponse s1, run.TrainStep(Batch(0), Ppo(), Adam()));
  v1::SaveStateRequest save;
  save.set_run_id(run.run_id());
  save.set_path(*dir_ + "/ckpt-" + run.run_id());
  ASSERT_OK(client_->SaveState(save));
  ASSERT_OK(run.TrainStep(Batch(1), Ppo(), Adam()));
  ASSERT_OK_AND_ASSIGN(v1::Run loaded, run.LoadState(save.path()));
  EXPECT_EQ(loaded.learner_version(), 1);
  v1::ExportAdapterRequest exp;
  exp.set_run_id(run.run_id());
  exp.set_path(*dir_ + "/peft-" + run.run_id());
  ASSERT_OK_AND_ASSIGN(v1::ExportAdapterResponse exported, client_->ExportAdapter(exp));
  EXPECT_EQ(exported.adapter_sha256(), s1.adapter_sha256());  // back at the saved adapter
  EXPECT_TRUE(PathExists(exp.path() + "/adapter_config.json"));
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(exp.path() + "/adapter_model.safetensors"));
  EXPECT_EQ(f.entries().size(), 2u * 7 * 2);
  // Plain paths (--allow_plain_paths) must be absolute, without "." or ".." components: each is
  // refused naming the field, and nothing changes (the run keeps its state).
  exp.set_path("peft-relative");
  EXPECT_THAT(client_->ExportAdapter(exp), StatusIs(absl::StatusCode::kInvalidArgument, "path: 'peft-relative' is relative"));
  save.set_path(*dir_ + "/../escaped");
  EXPECT_THAT(client_->SaveState(save), StatusIs(absl::StatusCode::kInvalidArgument, "'..' component"));
  EXPECT_FALSE(PathExists(*dir_ + "/../escaped"));
  EXPECT_THAT(run.LoadState(*dir_ + "/./ckpt-" + run.run_id()), StatusIs(absl::StatusCode::kInvalidArgument, "'.' component"));
  ASSERT_OK_AND_ASSIGN(v1::Run unchanged, client_->GetRun(run.run_id()));
  EXPECT_EQ(unchanged.learner_version(), 1);

  // Metric history and the stream: backlog first, then a new step as it happens.
  v1::GetStepMetricsRequest mreq;
  mreq.set_run_id(run.run_id());
  mreq.set_since_step(1);
  ASSERT_OK_AND_ASSIGN(v1::GetStepMetricsResponse history, client_->GetStepMetrics(mreq));
  ASSERT_EQ(history.steps_size(), 1);
  EXPECT_EQ(history.steps(0).step(), 1);
  EXPECT_GT(history.steps(0).metrics().at("tokens_per_s:sum"), 0);
  std::vector<int64_t> seen;
  std::thread watcher([&] {
    v1::WatchMetricsRequest w;
    w.set_run_id(run.run_id());
    absl::Status s = client_->WatchMetrics(w, [&](const v1::StepRecord& r) {
      seen.push_back(r.step());
      return seen.size() < 3;
    });
    EXPECT_TRUE(s.ok()) << s;
  });
  // No wait for the watcher to register: a step before registration is in its backlog, one
  // after reaches it, either way exactly once.
  ASSERT_OK(run.TrainStep(Batch(2), Ppo(), Adam()));
  watcher.join();
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2}));
}

}  // namespace
}  // namespace lorastep

namespace lorastep {
namespace {

// A coordinator started with no worker waits for workers to register themselves.
// Read-only calls answer from the run's view while a training step holds the run: they
// return before the step does, with the state before it.
TEST_F(ServiceTest, ReadOnlyCallsDoNotWaitForATrainingStep) {
  RunSession run = NewRun(21);
  std::vector<v1::Datum> long_batch;
  for (int i = 0; i < 128; ++i) long_batch.push_back(MakeDatum(i, 0, 500, 96));
  std::atomic<bool> step_done{false};
  std::atomic<int64_t> step_finished_ns{0};
  std::thread step([&] {
    auto r = run.TrainStep(long_batch, Ppo(), Adam());
    EXPECT_TRUE(r.ok()) << r.status();
    step_finished_ns = std::chrono::steady_clock::now().time_since_epoch().count();
    step_done = true;
  });
  // Into the step: the probes below run while it computes (checked after them), and no state
  // a client can read says the step has begun.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_FALSE(step_done.load()) << "the step ended before the probe: make it longer";
  ASSERT_OK_AND_ASSIGN(v1::Run during, client_->GetRun(run.run_id()));
  v1::GetStepMetricsRequest mreq;
  mreq.set_run_id(run.run_id());
  ASSERT_OK(client_->GetStepMetrics(mreq).status());
  ASSERT_OK(client_->ListRuns().status());
  const int64_t probes_done_ns = std::chrono::steady_clock::now().time_since_epoch().count();
  step.join();
  EXPECT_LT(probes_done_ns, step_finished_ns.load());
  EXPECT_EQ(during.learner_version(), 0);
  ASSERT_OK_AND_ASSIGN(v1::Run after, client_->GetRun(run.run_id()));
  EXPECT_EQ(after.learner_version(), 1);
}

// A spawned worker takes a batch the client packed as it came (the coordinator neither parses
// nor checks it; the worker does both, once), over gRPC (--noworker_pipe) as over the call
// pipe: the same steps, log-probs and refusals as the same datums sent one by one.
TEST_F(ServiceTest, SpawnedWorkerTakesThePackedBatchAsSentOverEitherTransport) {
  ASSERT_OK_AND_ASSIGN(ChildServer grpc_only,
                       ChildServer::Start(Binary("server/lorastep_coordinator"),
                                          {"--model", *dir_ + "/model", "--worker_binary",
                                           Binary("worker/lorastep_worker"), "--allow_plain_paths", "--noworker_pipe"},
                                          120));
  ASSERT_OK_AND_ASSIGN(auto grpc_client, TrainerClient::Connect(grpc_only.address()));
  RunSession piped = NewRun(/*seed=*/41);
  ASSERT_OK_AND_ASSIGN(RunSession packed, RunSession::Create(grpc_client.get(), Lora(), 41));
  ASSERT_OK_AND_ASSIGN(RunSession repeated, RunSession::Create(grpc_client.get(), Lora(), 41));
  repeated.pack_datums = false;
  for (int step = 0; step < 2; ++step) {
    ASSERT_OK_AND_ASSIGN(v1::StepResponse a, piped.TrainStep(Batch(step), Ppo(), Adam()));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse b, packed.TrainStep(Batch(step), Ppo(), Adam()));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse c, repeated.TrainStep(Batch(step), Ppo(), Adam()));
    EXPECT_EQ(a.adapter_sha256(), b.adapter_sha256()) << step;
    EXPECT_EQ(b.adapter_sha256(), c.adapter_sha256()) << step;
    EXPECT_EQ(a.metrics().at("loss:sum"), b.metrics().at("loss:sum")) << step;
  }
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fa, piped.Forward(Batch(5)));
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fb, packed.Forward(Batch(5)));
  ASSERT_EQ(fa.logprobs_size(), fb.logprobs_size());
  for (int i = 0; i < fa.logprobs_size(); ++i) {
    ASSERT_EQ(fa.logprobs(i).values_size(), fb.logprobs(i).values_size());
    for (int j = 0; j < fa.logprobs(i).values_size(); ++j) EXPECT_EQ(fa.logprobs(i).values(j), fb.logprobs(i).values(j));
  }
  for (const ValidationCase& c : ValidationCases()) {
    v1::TrainStepRequest bad = BadTrainStep(packed.run_id(), c);
    bad.set_sequence_id(packed.next_sequence_id());
    EXPECT_THAT(grpc_client->TrainStep(bad), StatusIs(absl::StatusCode::kInvalidArgument, c.message)) << c.what;
  }
  ASSERT_OK_AND_ASSIGN(v1::Run after, grpc_client->GetRun(packed.run_id()));
  EXPECT_EQ(after.learner_version(), 2);
  EXPECT_EQ(after.next_sequence_id(), packed.next_sequence_id());
}

// lorastep_coordinator_with_worker --in_process_worker starts no child process and answers
// every call as a coordinator with its spawned worker process does.
TEST(InProcessWorkerTest, AnswersLikeTheWorkerProcess) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, TinyModelDir("in_process"));
  const std::string coordinator = Binary("server/lorastep_coordinator");
  const std::string with_worker = Binary("server/lorastep_coordinator_with_worker");
  ASSERT_OK_AND_ASSIGN(ChildServer process,
                       ChildServer::Start(coordinator,
                                          {"--model", dir + "/model", "--worker_binary",
                                           Binary("worker/lorastep_worker"), "--state_dir", dir + "/store_p"},
                                          120));
  const std::vector<std::string> in_process_args = {"--model", dir + "/model", "--in_process_worker",
                                                    "--state_dir", dir + "/store_i"};
  auto in_process = std::make_unique<ChildServer>(ChildServer::Start(with_worker, in_process_args, 120).value());
  const std::string children = absl::StrCat("pgrep -P ", in_process->pid(), " > /dev/null");
  EXPECT_NE(system(children.c_str()), 0) << "--in_process_worker started a child process";
  ASSERT_OK_AND_ASSIGN(auto pc, TrainerClient::Connect(process.address()));
  ASSERT_OK_AND_ASSIGN(auto ic, TrainerClient::Connect(in_process->address()));
  ASSERT_OK_AND_ASSIGN(RunSession p, RunSession::Create(pc.get(), Lora(), 9, "same"));
  ASSERT_OK_AND_ASSIGN(RunSession i, RunSession::Create(ic.get(), Lora(), 9, "same"));
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK_AND_ASSIGN(v1::StepResponse a, p.TrainStep(Batch(step), Ppo(), Adam()));
    ASSERT_OK_AND_ASSIGN(v1::StepResponse b, i.TrainStep(Batch(step), Ppo(), Adam()));
    EXPECT_EQ(a.adapter_sha256(), b.adapter_sha256()) << step;
    EXPECT_EQ(a.learner_version(), b.learner_version()) << step;
    EXPECT_EQ(a.metrics().at("loss:sum"), b.metrics().at("loss:sum")) << step;
  }
  // At world size 1 the in-process worker's trainer validates alone (the coordinator does
  // not check the batch again): the same refusals, word for word, and nothing applied.
  for (const ValidationCase& c : ValidationCases()) {
    v1::TrainStepRequest bad = BadTrainStep("same", c);
    bad.set_sequence_id(p.next_sequence_id());
    const absl::Status by_process = pc->TrainStep(bad).status();
    const absl::Status in_process = ic->TrainStep(bad).status();
    EXPECT_THAT(in_process, StatusIs(absl::StatusCode::kInvalidArgument, c.message)) << c.what;
    EXPECT_EQ(in_process, by_process) << c.what;
    // Cases of the optimizer's fields or the request id make a valid ForwardBackward.
    if (!absl::StartsWith(c.message, "datums") && !absl::StartsWith(c.message, "packed") &&
        !absl::StartsWith(c.message, "loss.")) {
      continue;
    }
    v1::ForwardBackwardRequest fb;
    fb.set_run_id("same");
    fb.set_request_id(bad.request_id() + "-fb");
    fb.set_sequence_id(bad.sequence_id());
    *fb.mutable_datums() = bad.datums();
    *fb.mutable_packed_datums() = bad.packed_datums();
    *fb.mutable_loss() = bad.loss();
    EXPECT_EQ(ic->ForwardBackward(fb).status(), pc->ForwardBackward(fb).status()) << c.what;
    v1::ForwardRequest fwd;
    fwd.set_run_id("same");
    *fwd.mutable_datums() = bad.datums();
    *fwd.mutable_packed_datums() = bad.packed_datums();
    EXPECT_EQ(ic->Forward(fwd).status(), pc->Forward(fwd).status()) << c.what;
  }
  ASSERT_OK_AND_ASSIGN(v1::Run after_p, pc->GetRun("same"));
  ASSERT_OK_AND_ASSIGN(v1::Run after_i, ic->GetRun("same"));
  EXPECT_EQ(after_i.learner_version(), 3);
  EXPECT_EQ(after_i.learner_version(), after_p.learner_version());
  EXPECT_EQ(after_i.next_sequence_id(), after_p.next_sequence_id());
  EXPECT_EQ(after_i.pending_forward_backward(), 0);
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fa, p.ForwardBackward(Batch(3), Ppo()));
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fb, i.ForwardBackward(Batch(3), Ppo()));
  EXPECT_EQ(fa.metrics().at("loss:sum"), fb.metrics().at("loss:sum"));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse oa, p.OptimStep(Adam()));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse ob, i.OptimStep(Adam()));
  EXPECT_EQ(oa.adapter_sha256(), ob.adapter_sha256());
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse la, p.Forward(Batch(4)));
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse lb, i.Forward(Batch(4)));
  ASSERT_EQ(la.logprobs_size(), lb.logprobs_size());
  for (int d = 0; d < la.logprobs_size(); ++d) {
    ASSERT_EQ(la.logprobs(d).values_size(), lb.logprobs(d).values_size());
    for (int t = 0; t < la.logprobs(d).values_size(); ++t) EXPECT_EQ(la.logprobs(d).values(t), lb.logprobs(d).values(t));
  }
  // A retried request is answered from the record, not applied again.
  v1::TrainStepRequest retried;
  retried.set_run_id("same");
  retried.set_request_id("in-process-retry");
  retried.set_sequence_id(i.next_sequence_id());
  for (const auto& d : Batch(5)) *retried.add_datums() = d;
  *retried.mutable_loss() = Ppo();
  *retried.mutable_adamw() = Adam();
  ASSERT_OK_AND_ASSIGN(v1::StepResponse first, ic->TrainStep(retried));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse again, ic->TrainStep(retried));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(first, again));
  EXPECT_EQ(first.learner_version(), 5);
  // Checkpoints through the state store, and a fork from one.
  v1::SaveStateRequest save;
  save.set_run_id("same");
  save.set_path("lorastep://same/step-5");
  ASSERT_OK(ic->SaveState(save).status());
  EXPECT_TRUE(PathExists(dir + "/store_i/runs/same/step-5/trainer_state.json"));
  ASSERT_OK_AND_ASSIGN(RunSession fork, RunSession::Create(ic.get(), Lora(), 1, "fork"));
  ASSERT_OK_AND_ASSIGN(v1::Run loaded, fork.LoadState("lorastep://same/step-5"));
  EXPECT_EQ(loaded.learner_version(), 5);
  // SIGKILL: the journal (on by default with --state_dir) brings the run back.
  WaitUntilAutosaved(ic.get(), "same", 5);
  ASSERT_EQ(kill(in_process->pid(), SIGKILL), 0);
  in_process.reset();
  ASSERT_OK_AND_ASSIGN(ChildServer restarted, ChildServer::Start(with_worker, in_process_args, 120));
  ASSERT_OK_AND_ASSIGN(auto rc, TrainerClient::Connect(restarted.address()));
  ASSERT_OK_AND_ASSIGN(v1::Run back, rc->GetRun("same"));
  EXPECT_EQ(back.learner_version(), 5);
  ASSERT_OK_AND_ASSIGN(v1::StepResponse replayed, rc->TrainStep(retried));
  EXPECT_EQ(replayed.adapter_sha256(), first.adapter_sha256());
  // Flags that need a worker process (or several) are refused, naming the flag.
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--tp", "2"}, {"--worker_metrics_port_base", "9100"},
        {"--worker_binary", Binary("worker/lorastep_worker")}}) {
    std::string cmd = with_worker + " --model " + dir + "/model --in_process_worker --port 0";
    for (const std::string& a : extra) cmd += " " + a;
    cmd += " 2> " + dir + "/refused.txt";
    EXPECT_NE(system(cmd.c_str()), 0) << cmd;
    ASSERT_OK_AND_ASSIGN(std::string err, ReadFileToString(dir + "/refused.txt"));
    EXPECT_THAT(err, ::testing::HasSubstr("in_process_worker: cannot be combined with " + extra[0])) << err;
  }
  // The LibTorch-free lorastep_coordinator has no worker inside, and says which binary has.
  const std::string cmd = coordinator + " --model " + dir + "/model --in_process_worker --port 0 2> " + dir + "/nw.txt";
  EXPECT_NE(system(cmd.c_str()), 0);
  ASSERT_OK_AND_ASSIGN(std::string err, ReadFileToString(dir + "/nw.txt"));
  EXPECT_THAT(err, ::testing::HasSubstr("run lorastep_coordinator_with_worker")) << err;
  // The polling times are bounded: the executors' after each call, the gRPC poller's after
  // each answer.
  for (const char* flag : {"executor_spin_us", "grpc_poller_warm_us"}) {
    for (const char* value : {"-1", "100001"}) {
      const std::string bad = coordinator + " --model " + dir + "/model --port 0 --" + flag + " " + value + " 2> " +
                              dir + "/spin.txt";
      EXPECT_NE(system(bad.c_str()), 0) << bad;
      ASSERT_OK_AND_ASSIGN(std::string why, ReadFileToString(dir + "/spin.txt"));
      EXPECT_THAT(why, ::testing::HasSubstr(std::string(flag) + ": must be in [0, 100000]")) << why;
    }
  }
  // The worker's device-call threads poll too, within the same bounds.
  for (const char* spin : {"-1", "100001"}) {
    const std::string worker = Binary("worker/lorastep_worker") + " --model " + dir +
                               "/model --allow_plain_paths --port 0 --executor_spin_us " + spin + " 2> " + dir +
                               "/worker_spin.txt";
    EXPECT_NE(system(worker.c_str()), 0) << worker;
    ASSERT_OK_AND_ASSIGN(std::string worker_why, ReadFileToString(dir + "/worker_spin.txt"));
    EXPECT_THAT(worker_why, ::testing::HasSubstr("--executor_spin_us: must be in [0, 100000]")) << worker_why;
  }
  // So is the co-scheduling window (no negative wait).
  {
    const std::string bad = coordinator + " --model " + dir + "/model --port 0 --coschedule_window_us -5 2> " + dir +
                            "/window.txt";
    EXPECT_NE(system(bad.c_str()), 0) << bad;
    ASSERT_OK_AND_ASSIGN(std::string why, ReadFileToString(dir + "/window.txt"));
    EXPECT_THAT(why, ::testing::HasSubstr("coschedule_window_us: must be >= 0")) << why;
  }
  // So is the local workers' activation recomputation.
  const std::string bad = coordinator + " --model " + dir + "/model --port 0 --activation_recompute sometimes 2> " +
                          dir + "/recompute.txt";
  EXPECT_NE(system(bad.c_str()), 0) << bad;
  ASSERT_OK_AND_ASSIGN(std::string why, ReadFileToString(dir + "/recompute.txt"));
  EXPECT_THAT(why, ::testing::HasSubstr("activation_recompute: \"sometimes\" is not")) << why;
}

// The journal's autosave markers: a background autosave's marker counts only once a later
// record says that autosave is durable. Recovery cuts the file at the last durable marker
// and rewrites it so that marker stands on its own (durable, no done records): recovering
// again agrees. A marker of an older journal (no name, not pending) names "autosave".
TEST(RunJournalTest, PendingMarkersCountOnlyOnceDurable) {
  const std::string dir = ScratchDir("run_journal");
  ASSERT_OK_AND_ASSIGN(RunJournal journal, RunJournal::Open(dir));
  v1::JournalRun created;
  created.mutable_run()->set_run_id("r");
  ASSERT_OK(journal.AddRun(created));
  auto call = [](const std::string& id, int64_t version) {
    v1::JournalEntry e;
    e.set_request_id(id);
    e.set_method("TrainStep");
    e.mutable_run()->set_learner_version(version);
    return e;
  };
  auto marker = [](const std::string& name, int64_t version, bool pending) {
    v1::JournalEntry e;
    e.set_autosave_marker(true);
    e.set_autosave_name(name);
    e.set_autosave_pending(pending);
    e.mutable_run()->set_learner_version(version);
    return e;
  };
  auto done = [](const std::string& name) {
    v1::JournalEntry e;
    e.set_autosave_done(name);
    return e;
  };
  for (const v1::JournalEntry& e : {call("s1", 1), marker("autosave-1", 1, true), call("s2", 2),
                                    marker("autosave-2", 2, true), done("autosave-1"), call("s3", 3)}) {
    ASSERT_OK(journal.Append("r", e, false));
  }
  for (int again = 0; again < 2; ++again) {
    ASSERT_OK_AND_ASSIGN(JournaledRun r, journal.RecoverRun("r"));
    EXPECT_TRUE(r.autosaved);
    EXPECT_EQ(r.autosave_name, "autosave-1") << again;
    EXPECT_EQ(r.run.learner_version(), 1);
    ASSERT_EQ(r.entries.size(), 2u) << again;  // s1 and its marker, durable now
    EXPECT_FALSE(r.entries[1].autosave_pending());
    ASSERT_OK(journal.Settle(r));  // as the coordinator does once the run is restored
  }
  for (const v1::JournalEntry& e : {call("s2b", 2), marker("autosave-2", 2, true), done("autosave-2"),
                                    call("s3", 3), marker("autosave-3", 3, true)}) {
    ASSERT_OK(journal.Append("r", e, false));
  }
  ASSERT_OK_AND_ASSIGN(JournaledRun r, journal.RecoverRun("r"));
  EXPECT_EQ(r.autosave_name, "autosave-2");  // autosave-3 never became durable
  EXPECT_EQ(r.run.learner_version(), 2);
  ASSERT_EQ(r.entries.size(), 4u);
  for (const auto& e : r.entries) EXPECT_TRUE(e.autosave_done().empty());
  v1::JournalEntry old_format;
  old_format.set_autosave_marker(true);
  old_format.mutable_run()->set_learner_version(2);
  ASSERT_OK(journal.Append("r", old_format, true));
  ASSERT_OK_AND_ASSIGN(r, journal.RecoverRun("r"));
  EXPECT_EQ(r.autosave_name, "autosave");
  // No durable marker at all: back to creation.
  ASSERT_OK(journal.RemoveRun("r"));
  ASSERT_OK(journal.AddRun(created));
  ASSERT_OK(journal.Append("r", call("s1", 1), false));
  ASSERT_OK(journal.Append("r", marker("autosave-1", 1, true), false));
  ASSERT_OK_AND_ASSIGN(r, journal.RecoverRun("r"));
  EXPECT_FALSE(r.autosaved);
  EXPECT_TRUE(r.entries.empty());
}

// Issue 8: a coordinator killed with SIGKILL (its local worker dies with it) and started
// again with the same --journal_dir and --state_dir brings its runs back as of their last
// autosave: learner_version, sequence id, step history, request records (a retried step is
// answered from the record, not applied again) and the optimizer state (the next step
// equals an uninterrupted run's); a ForwardBackward after the last step is dropped and the
// sequence id says so. The journal itself is checked for a torn tail.
// Issue 8: without --state_dir, a coordinator on a fixed port keeps its store and journal
// under <default root>/port-<port>. SIGKILLed and started again on that port it brings its
// runs back (the defect: killing a coordinator started with the defaults lost every run);
// a coordinator on another port does not see them, and --port 0 keeps no journal. The
// default journal spaces autosaves by their cost (the first step is always saved): with
// --autosave_max_share 1e-6 no second autosave is due, so the run returns at learner
// version 1; with --autosave_every_steps 1 it returns at its last step.
}  // namespace
}  // namespace lorastep
