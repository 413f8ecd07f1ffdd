// The service's state store and bounds with real processes on 127.0.0.1 (a
// lorastep_coordinator spawning its local lorastep_worker, driven through gRPC): adapters
// uploaded over the API, lorastep:// references, activation budgets, request and run caps,
// per-run queues, slow watchers. No mocks.
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

namespace lorastep {
namespace {

using namespace ::lorastep::service_testing;  // NOLINT: the shared helpers, unqualified

// Sends a PEFT adapter's files through UploadAdapter in `piece`-byte chunks (the first
// message names the run and the reference); `extra` messages are sent after them.
absl::StatusOr<v1::UploadAdapterResponse> Upload(const std::string& address, const std::string& run_id,
                                                 const std::string& path, const std::string& config,
                                                 const std::string& model, size_t piece = 1 << 16,
                                                 const std::vector<v1::UploadAdapterChunk>& extra = {},
                                                 bool replace = false) {
  auto stub = v1::Trainer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::UploadAdapterResponse resp;
  auto writer = stub->UploadAdapter(&ctx, &resp);
  bool first = true;
  for (const auto& [file, bytes] : {std::pair<std::string, const std::string*>{"adapter_config.json", &config},
                                    {"adapter_model.safetensors", &model}}) {
    for (size_t at = 0; at < bytes->size(); at += piece) {
      v1::UploadAdapterChunk chunk;
      if (first) {
        chunk.set_run_id(run_id);
        chunk.set_path(path);
        chunk.set_replace(replace);
        first = false;
      }
      chunk.set_file(file);
      chunk.set_data(bytes->substr(at, piece));
      if (!writer->Write(chunk)) break;  // the server refused already: Finish says why
    }
  }
  for (const auto& chunk : extra) writer->Write(chunk);
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

// Issue 26, point 9: an outside PEFT adapter is sent over the API (no --allow_plain_paths, no
// copying into the worker's store by hand), checked like init_from, stored as
// lorastep://<run>/<name>, and a run started from it holds exactly its weights. Anything that
// would not load stores nothing.
TEST(StateStoreServiceTest, UploadedAdapterIsCheckedStoredAndStartsARun) {
  const std::string scratch = ScratchDir("upload_service");
  const std::string root = scratch + "/state";
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("upload_coord", {"--state_dir", root,
                                                                                 "--max_upload_mb", "1"}));
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server.address()));
  TrainerClient* t = client.get();
  // The outside adapter: another run's export, read back as plain bytes.
  ASSERT_OK_AND_ASSIGN(RunSession source, RunSession::Create(t, Lora(), 1, "source"));
  ASSERT_OK(source.TrainStep(Batch(0), Ppo(), Adam()).status());
  v1::ExportAdapterRequest exp;
  exp.set_run_id("source");
  exp.set_path("lorastep://source/peft");
  ASSERT_OK_AND_ASSIGN(v1::ExportAdapterResponse exported, t->ExportAdapter(exp));
  ASSERT_OK_AND_ASSIGN(std::string config, ReadFileToString(root + "/runs/source/peft/adapter_config.json"));
  ASSERT_OK_AND_ASSIGN(std::string model, ReadFileToString(root + "/runs/source/peft/adapter_model.safetensors"));
  ASSERT_OK_AND_ASSIGN(RunSession holder, RunSession::Create(t, Lora(), 2, "holder"));
  ASSERT_OK_AND_ASSIGN(v1::UploadAdapterResponse up,
                       Upload(server.address(), "holder", "lorastep://holder/imported", config, model, 4096));
  EXPECT_EQ(up.path(), "lorastep://holder/imported");
  EXPECT_EQ(up.bytes(), static_cast<int64_t>(config.size() + model.size()));
  v1::CreateRunRequest from;
  from.set_request_id("from-upload");
  *from.mutable_lora() = Lora();
  from.set_run_id("started");
  from.set_init_from("lorastep://holder/imported");
  ASSERT_OK(t->CreateRun(from).status());
  exp.set_run_id("started");
  exp.set_path("lorastep://started/peft");
  ASSERT_OK_AND_ASSIGN(v1::ExportAdapterResponse again, t->ExportAdapter(exp));
  EXPECT_EQ(again.adapter_sha256(), exported.adapter_sha256()) << "the started run holds other weights";
  // Refused, each naming the field, and nothing stored.
  std::string bad_model = model;
  bad_model.resize(model.size() / 2);
  v1::LoraConfig other_rank = Lora();
  other_rank.set_rank(2);
  v1::UploadAdapterChunk stray;
  stray.set_file("../../etc/passwd");
  stray.set_data("x");
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/torn", config, bad_model),
              StatusIs(absl::StatusCode::kInvalidArgument, "adapter_model.safetensors"));
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/stray", config, model, 1 << 16, {stray}),
              StatusIs(absl::StatusCode::kInvalidArgument, "file: '../../etc/passwd' is not"));
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/nomodel", config, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, "file: both"));
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://source/x", config, model),
              StatusIs(absl::StatusCode::kInvalidArgument, "its own references"));
  EXPECT_THAT(Upload(server.address(), "nobody", "lorastep://nobody/x", config, model),
              StatusIs(absl::StatusCode::kNotFound, "run_id: no run 'nobody'"));
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/huge", config, std::string(2 << 20, 'x')),
              StatusIs(absl::StatusCode::kResourceExhausted, "max_upload_mb"));
  ASSERT_OK_AND_ASSIGN(RunSession rank2, RunSession::Create(t, other_rank, 3, "rank2"));
  EXPECT_THAT(Upload(server.address(), "rank2", "lorastep://rank2/imported", config, model),
              StatusIs(absl::StatusCode::kInvalidArgument, "adapter_config.json"));
  for (const char* name : {"torn", "stray", "nomodel", "huge"}) {
    EXPECT_FALSE(PathExists(absl::StrCat(root, "/runs/holder/", name))) << name;
  }
  EXPECT_FALSE(PathExists(root + "/runs/rank2/imported"));
  // An existing name: ALREADY_EXISTS unless replace, which replaces a PEFT folder and never a
  // SaveState checkpoint (that one used to be replaced silently, and LoadState then failed).
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/imported", config, model),
              StatusIs(absl::StatusCode::kAlreadyExists, "path: lorastep://holder/imported exists"));
  ASSERT_OK(Upload(server.address(), "holder", "lorastep://holder/imported", config, model, 1 << 16, {},
                   /*replace=*/true)
                .status());
  v1::SaveStateRequest save;
  save.set_run_id("holder");
  save.set_path("lorastep://holder/ck");
  ASSERT_OK(t->SaveState(save).status());
  EXPECT_THAT(Upload(server.address(), "holder", "lorastep://holder/ck", config, model, 1 << 16, {}, true),
              StatusIs(absl::StatusCode::kFailedPrecondition, "holds a SaveState checkpoint"));
  ASSERT_OK(holder.LoadState("lorastep://holder/ck").status());  // the checkpoint is whole
}

// Issue 8's state store: with --state_dir, SaveState / ExportAdapter / LoadState take
// lorastep://<run>/<name> references resolved under the server's root; plain paths,
// escapes and writes under another run are refused; a run's folders can be listed and
// deleted; run ids follow the same name rules.
TEST(StateStoreServiceTest, ReferencesListAndDeleteUnderTheServersRoot) {
  const std::string scratch = ScratchDir("store_service");
  const std::string root = scratch + "/state";
  auto server = StartTinyCoordinator("store_coord", {"--state_dir", root});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  TrainerClient* t = client->get();
  EXPECT_THAT(RunSession::Create(t, Lora(), 1, "../evil"), StatusIs(absl::StatusCode::kInvalidArgument, "run_id"));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(t, Lora(), 1, "alpha"));
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  auto save = [&](const std::string& path) {
    v1::SaveStateRequest req;
    req.set_run_id("alpha");
    req.set_path(path);
    return t->SaveState(req);
  };
  ASSERT_OK(save("lorastep://alpha/step-1").status());
  EXPECT_TRUE(PathExists(root + "/runs/alpha/step-1/trainer_state.json"));
  EXPECT_THAT(save(scratch + "/plain"), StatusIs(absl::StatusCode::kInvalidArgument, "reference"));
  EXPECT_THAT(save("lorastep://beta/x"), StatusIs(absl::StatusCode::kInvalidArgument, "its own references"));
  EXPECT_THAT(save("lorastep://alpha/../../x"), StatusIs(absl::StatusCode::kInvalidArgument, "path (name)"));
  v1::ExportAdapterRequest exp;
  exp.set_run_id("alpha");
  exp.set_path("lorastep://alpha/peft-1");
  ASSERT_OK(t->ExportAdapter(exp).status());
  EXPECT_TRUE(PathExists(root + "/runs/alpha/peft-1/adapter_model.safetensors"));
  v1::ListCheckpointsRequest list;
  list.set_run_id("alpha");
  WaitUntilAutosaved(t, "alpha", 1);
  ASSERT_OK_AND_ASSIGN(v1::ListCheckpointsResponse listed, t->ListCheckpoints(list));
  // With a state root the run is journaled by default: its autosave is listed too. Its
  // names are the journal's: a client may read them, not write or delete them.
  ASSERT_EQ(listed.checkpoints_size(), 3) << listed.DebugString();
  EXPECT_EQ(listed.checkpoints(0).name(), "autosave-1");
  EXPECT_THAT(save("lorastep://alpha/autosave-1"),
              StatusIs(absl::StatusCode::kInvalidArgument, "path: lorastep://alpha/autosave-1 is a name the journal keeps"));
  EXPECT_THAT(save("lorastep://alpha/autosave"), StatusIs(absl::StatusCode::kInvalidArgument, "the journal keeps"));
  exp.set_path("lorastep://alpha/autosave-9");
  EXPECT_THAT(t->ExportAdapter(exp), StatusIs(absl::StatusCode::kInvalidArgument, "the journal keeps"));
  v1::DeleteCheckpointRequest del_autosave;
  del_autosave.set_run_id("alpha");
  del_autosave.set_name("autosave-1");
  EXPECT_THAT(t->DeleteCheckpoint(del_autosave),
              StatusIs(absl::StatusCode::kInvalidArgument, "name: lorastep://alpha/autosave-1 is a name"));
  ASSERT_OK(save("lorastep://alpha/autosave-x").status());  // not one of its names
  ASSERT_OK_AND_ASSIGN(listed, t->ListCheckpoints(list));
  ASSERT_EQ(listed.checkpoints_size(), 4) << listed.DebugString();
  EXPECT_EQ(listed.checkpoints(1).name(), "autosave-x");
  del_autosave.set_name("autosave-x");
  ASSERT_OK(t->DeleteCheckpoint(del_autosave));
  ASSERT_OK_AND_ASSIGN(listed, t->ListCheckpoints(list));
  ASSERT_EQ(listed.checkpoints_size(), 3) << listed.DebugString();
  EXPECT_TRUE(PathExists(root + "/.journal/alpha/run.pb"));
  EXPECT_EQ(listed.checkpoints(1).name(), "peft-1");
  EXPECT_EQ(listed.checkpoints(2).ref(), "lorastep://alpha/step-1");
  EXPECT_GT(listed.checkpoints(2).bytes(), 0);
  // Another run starts from alpha's checkpoint by reference.
  ASSERT_OK_AND_ASSIGN(RunSession fork, RunSession::Create(t, Lora(), 2, "beta"));
  ASSERT_OK_AND_ASSIGN(v1::Run loaded, fork.LoadState("lorastep://alpha/step-1"));
  EXPECT_EQ(loaded.learner_version(), 1);
  v1::DeleteCheckpointRequest del;
  del.set_run_id("alpha");
  del.set_name("peft-1");
  ASSERT_OK(t->DeleteCheckpoint(del).status());
  EXPECT_FALSE(PathExists(root + "/runs/alpha/peft-1"));
  EXPECT_THAT(t->DeleteCheckpoint(del), StatusIs(absl::StatusCode::kNotFound, "does not exist"));
  del.set_name("..");
  EXPECT_THAT(t->DeleteCheckpoint(del), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  ASSERT_OK_AND_ASSIGN(listed, t->ListCheckpoints(list));
  EXPECT_EQ(listed.checkpoints_size(), 2);
  // Refusals name the reference, never the server's folders: a missing one is NOT_FOUND,
  // and a damaged checkpoint's error speaks of its reference (the run is left as it was).
  auto refused = fork.LoadState("lorastep://alpha/never-saved");
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kNotFound, "path: lorastep://alpha/never-saved: nothing is saved"));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::Not(::testing::HasSubstr(root)));
  ASSERT_OK(WriteStringToFile(root + "/runs/alpha/step-1/trainer_state.json", "{\"optimizer_steps\": \"seven\"}"));
  auto damaged = fork.LoadState("lorastep://alpha/step-1");
  EXPECT_FALSE(damaged.ok());
  EXPECT_THAT(std::string(damaged.status().message()), ::testing::HasSubstr("lorastep://alpha/step-1"));
  EXPECT_THAT(std::string(damaged.status().message()), ::testing::Not(::testing::HasSubstr(root)));
  ASSERT_OK_AND_ASSIGN(v1::Run unchanged, t->GetRun("beta"));
  EXPECT_EQ(unchanged.learner_version(), 1);
}

// Issue 8: a coordinator started without --state_dir keeps its state in the default root
// ($XDG_STATE_HOME/lorastep here). A plain path is refused naming the field, and no folder
// is made for it (the defect: any path was written, missing parents created); a reference
// lands under the root. --allow_plain_paths together with --state_dir is refused at start.
TEST(StateStoreServiceTest, DefaultRootRefusesPlainPaths) {
  const std::string scratch = ScratchDir("default_root");
  ASSERT_EQ(setenv("XDG_STATE_HOME", (scratch + "/xdg").c_str(), 1), 0);
  auto server = StartTinyCoordinator("default_root_model");
  ASSERT_EQ(unsetenv("XDG_STATE_HOME"), 0);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server->address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 1, "gamma"));
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  v1::SaveStateRequest save;
  save.set_run_id("gamma");
  save.set_path(scratch + "/new/parent/ckpt");
  EXPECT_THAT(client->SaveState(save), StatusIs(absl::StatusCode::kInvalidArgument, "path: must be a lorastep://"));
  EXPECT_FALSE(PathExists(scratch + "/new"));
  v1::ExportAdapterRequest exp;
  exp.set_run_id("gamma");
  exp.set_path(scratch + "/peft");
  EXPECT_THAT(client->ExportAdapter(exp), StatusIs(absl::StatusCode::kInvalidArgument, "path: must be a lorastep://"));
  EXPECT_THAT(run.LoadState(scratch + "/new"), StatusIs(absl::StatusCode::kInvalidArgument, "path: must be a lorastep://"));
  save.set_path("lorastep://gamma/step-1");
  ASSERT_OK(client->SaveState(save).status());
  EXPECT_TRUE(PathExists(scratch + "/xdg/lorastep/runs/gamma/step-1/trainer_state.json"));
  ASSERT_OK_AND_ASSIGN(v1::Run got, client->GetRun("gamma"));
  EXPECT_EQ(got.learner_version(), 1);
  auto both = StartTinyCoordinator("default_root_both", {"--allow_plain_paths", "--state_dir", scratch + "/s"});
  EXPECT_FALSE(both.ok()) << "--allow_plain_paths with --state_dir is refused";
}

// --max_activation_mb reaches the worker: a micro-batch over it is RESOURCE_EXHAUSTED
// through the API before any work, and the run is unchanged.
TEST(BoundsTest, ActivationBudgetRefusesAnOversizedMicroBatch) {
  auto server = StartTinyCoordinator("actbudget", {"--max_activation_mb", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto run = RunSession::Create(client->get(), Lora(), 1);
  ASSERT_TRUE(run.ok()) << run.status();
  std::vector<v1::Datum> long_one = {MakeDatum(0, 0, 500, 96)};
  EXPECT_THAT(run->TrainStep(long_one, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "over this worker's budget of 1 MiB"));
  ASSERT_OK_AND_ASSIGN(v1::Run state, (*client)->GetRun(run->run_id()));
  EXPECT_EQ(state.learner_version(), 0);
  ASSERT_OK(run->TrainStep(Batch(0), Ppo(), Adam()).status());
}

// A call's activation_recompute (issue 29) overrides the worker's: "full" recomputes every
// micro-batch, "none" none; an unknown mode is INVALID_ARGUMENT naming the field, for
// TrainStep and ForwardBackward alike, and changes nothing.
TEST(BoundsTest, CallChoosesActivationRecomputation) {
  auto server = StartTinyCoordinator("recompute_call", {});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  TrainerClient* t = client->get();
  auto run = RunSession::Create(t, Lora(), 1);
  ASSERT_TRUE(run.ok()) << run.status();
  auto step = [&](const std::string& mode, int64_t sequence_id) {
    v1::TrainStepRequest req;
    req.set_run_id(run->run_id());
    req.set_request_id("recompute-" + std::to_string(sequence_id));
    req.set_sequence_id(sequence_id);
    for (const v1::Datum& d : Batch(0)) *req.add_datums() = d;
    *req.mutable_loss() = Ppo();
    *req.mutable_adamw() = Adam();
    req.set_activation_recompute(mode);
    return t->TrainStep(req);
  };
  EXPECT_THAT(step("sometimes", 1), StatusIs(absl::StatusCode::kInvalidArgument, "activation_recompute: \"sometimes\""));
  v1::ForwardBackwardRequest fb;
  fb.set_run_id(run->run_id());
  fb.set_request_id("recompute-fb");
  fb.set_sequence_id(1);
  for (const v1::Datum& d : Batch(0)) *fb.add_datums() = d;
  *fb.mutable_loss() = Ppo();
  fb.set_activation_recompute("partly");
  EXPECT_THAT(t->ForwardBackward(fb), StatusIs(absl::StatusCode::kInvalidArgument, "activation_recompute: \"partly\""));
  ASSERT_OK_AND_ASSIGN(v1::Run state, t->GetRun(run->run_id()));
  EXPECT_EQ(state.learner_version(), 0);
  EXPECT_EQ(state.pending_forward_backward(), 0);
  ASSERT_OK_AND_ASSIGN(v1::StepResponse full, step("full", 1));
  EXPECT_GT(full.metrics().at("micro_batches_recomputed:sum"), 0);
  EXPECT_EQ(full.metrics().at("micro_batches_recomputed:sum"), full.metrics().at("micro_batches:sum"));
  ASSERT_OK_AND_ASSIGN(v1::StepResponse none, step("none", 2));
  EXPECT_EQ(none.metrics().at("micro_batches_recomputed:sum"), 0);
  fb.set_activation_recompute("full");
  fb.set_sequence_id(3);
  ASSERT_OK_AND_ASSIGN(v1::ForwardBackwardResponse fbr, t->ForwardBackward(fb));
  EXPECT_GT(fbr.metrics().at("micro_batches_recomputed:sum"), 0);
}

// Bounds: a coordinator with --max_request_mb 1 --max_runs 2 refuses a larger request
// before parsing it (the run unchanged) and a third run; DeleteRun frees a slot, and the
// deleted run is gone everywhere.
TEST(BoundsTest, RequestSizeAndRunCapAndDeleteRun) {
  auto server = StartTinyCoordinator("bounds", {"--max_request_mb", "1", "--max_runs", "2", "--max_recorded_mb", "0.25"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  TrainerClient* t = client->get();
  auto a = RunSession::Create(t, Lora(), 1);
  auto b = RunSession::Create(t, Lora(), 2);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_THAT(RunSession::Create(t, Lora(), 3),
              StatusIs(absl::StatusCode::kResourceExhausted, "max_runs: 2 runs exist"));
  // ~1.5 MB of datums: over the 1 MiB limit.
  std::vector<v1::Datum> big;
  for (int i = 0; i < 48; ++i) big.push_back(MakeDatum(i, 0, 4000, 96));
  EXPECT_THAT(a->TrainStep(big, Ppo(), Adam()), StatusIs(absl::StatusCode::kResourceExhausted, ""));
  ASSERT_OK_AND_ASSIGN(v1::Run state, t->GetRun(a->run_id()));
  EXPECT_EQ(state.learner_version(), 0);
  ASSERT_OK(a->TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK(t->DeleteRun(a->run_id()));
  EXPECT_THAT(t->GetRun(a->run_id()), StatusIs(absl::StatusCode::kNotFound, "no run"));
  EXPECT_THAT(a->TrainStep(Batch(1), Ppo(), Adam()), StatusIs(absl::StatusCode::kNotFound, "no run"));
  EXPECT_THAT(t->DeleteRun(a->run_id()), StatusIs(absl::StatusCode::kNotFound, "no run"));
  ASSERT_OK_AND_ASSIGN(auto runs, t->ListRuns());
  EXPECT_EQ(runs.runs_size(), 1);
  auto c3 = RunSession::Create(t, Lora(), 3);  // the freed slot
  ASSERT_TRUE(c3.ok()) << c3.status();
  ASSERT_OK(c3->TrainStep(Batch(0), Ppo(), Adam()).status());
  // Recorded responses are bounded (0.25 MiB here): two supervised ForwardBackward calls of
  // 40k tokens (responses ~0.16 MB of log-probs each); the first's body is dropped, so its
  // retry is refused, not re-applied.
  v1::ForwardBackwardRequest first;
  first.set_run_id(c3->run_id());
  first.set_request_id("fb-first");
  first.set_sequence_id(c3->next_sequence_id());
  for (int i = 0; i < 80; ++i) {
    v1::Datum* d = first.add_datums();
    for (int j = 0; j < 500; ++j) {
      d->add_tokens((i + j) % 96);
      d->add_target_tokens((i * 7 + j) % 96);
    }
  }
  ASSERT_OK(t->ForwardBackward(first).status());
  v1::ForwardBackwardRequest second = first;
  second.set_request_id("fb-second");
  second.set_sequence_id(first.sequence_id() + 1);
  ASSERT_OK(t->ForwardBackward(second).status());
  EXPECT_THAT(t->ForwardBackward(first), StatusIs(absl::StatusCode::kFailedPrecondition, "no longer kept"));
  ASSERT_OK_AND_ASSIGN(v1::Run state3, t->GetRun(c3->run_id()));
  EXPECT_EQ(state3.pending_forward_backward(), 2);
  ASSERT_OK(t->ForwardBackward(second).status());  // the newest response is still kept
}

// --state_ttl_hours (passed to the local worker): an expired lorastep folder in the store is
// removed by the running server, a fresh one stays; a TTL without a store is refused.
TEST(BoundsTest, StateStoreTtlRemovesExpiredFolders) {
  const std::string root = ScratchDir("ttl_store");
  ASSERT_OK_AND_ASSIGN(StateStore store, StateStore::Open(root));
  for (const char* ref : {"lorastep://old-run/ck", "lorastep://old-run/fresh"}) {
    ASSERT_OK_AND_ASSIGN(std::string path, store.Resolve(ref, "path"));
    ASSERT_OK(WriteFolderAtomically(path, [](const std::string& tmp) { return WriteStringToFile(tmp + "/w", "1"); }));
  }
  const std::string old = root + "/runs/old-run/ck";
  const struct timeval two_days_ago[2] = {{std::time(nullptr) - 2 * 86400, 0}, {std::time(nullptr) - 2 * 86400, 0}};
  for (const std::string& p : {old + "/w", old + "/.lorastep", old}) utimes(p.c_str(), two_days_ago);
  auto server = StartTinyCoordinator("ttl_coord", {"--state_dir", root, "--state_ttl_hours", "24"});
  ASSERT_TRUE(server.ok()) << server.status();
  // The pruner runs at start, then every 2.4 h.
  const bool gone = testing::WaitFor([&] { return !PathExists(old); }, std::chrono::seconds(10));
  EXPECT_TRUE(gone) << old << " outlived its TTL";
  EXPECT_TRUE(PathExists(root + "/runs/old-run/fresh"));
  auto refused = StartTinyCoordinator("ttl_nostore", {"--allow_plain_paths", "--state_ttl_hours", "24"});
  EXPECT_FALSE(refused.ok()) << "a TTL without a state store is refused";
}

// Bounded queues: a run with --max_queued_per_run calls in flight refuses the next one at
// once (RESOURCE_EXHAUSTED naming the flag, with retry advice) while another run is served;
// every admitted call is answered.
TEST(BoundsTest, QueuePerRunIsBoundedWithRetryAdvice) {
  auto server = StartTinyCoordinator("queue_bound", {"--max_queued_per_run", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto busy = RunSession::Create(client->get(), Lora(), 1);
  auto other = RunSession::Create(client->get(), Lora(), 2);
  ASSERT_TRUE(busy.ok() && other.ok());
  std::vector<v1::Datum> big;
  for (int i = 0; i < 256; ++i) big.push_back(testing::RlDatum(i, 0, 200, 96));
  std::atomic<int> ok{0}, refused{0}, wrong{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      while (!go) std::this_thread::yield();
      v1::ForwardRequest req;
      req.set_run_id(busy->run_id());
      for (const auto& d : big) *req.add_datums() = d;
      auto r = (*client)->Forward(req);
      if (r.ok()) {
        ++ok;
      } else if (r.status().code() == absl::StatusCode::kResourceExhausted &&
                 r.status().message().find("max_queued_per_run: run '" + busy->run_id() + "' has 1 calls in flight; retry") !=
                     std::string::npos) {
        ++refused;
      } else {
        ++wrong;
      }
    });
  }
  go = true;
  // The busy run has a call in flight once one of the burst is refused for it.
  EXPECT_TRUE(testing::WaitFor([&] { return refused.load() >= 1; }, std::chrono::seconds(30)));
  EXPECT_TRUE(other->TrainStep(Batch(0), Ppo(), Adam()).ok()) << "another run is served meanwhile";
  for (auto& t : threads) t.join();
  EXPECT_GE(ok.load(), 1);
  EXPECT_GE(refused.load(), 1);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_TRUE(busy->TrainStep(Batch(0), Ppo(), Adam()).ok()) << "the run takes calls again once its queue drains";
}

// Admission per tenant (API key): a key at its share of the queue (--max_queued_per_key) or
// of the bytes its calls hold (--max_queued_mb_per_key) is refused by that name, while another
// key's calls are served; the per-key limits must stay below the whole, and an upload must fit
// a key's bytes (checked at start).
TEST(BoundsTest, AGreedyKeyCannotLockAnotherKeyOut) {
  const std::string dir = ScratchDir("tenant_share_keys");
  const std::string keys = dir + "/keys";
  ASSERT_TRUE(WriteStringToFile(keys, "greedy-key-0123456789 greedy\nother-key-0123456789 other\n").ok());
  for (const auto& [flags, named] : std::vector<std::pair<std::string, std::string>>{
           {"--max_queued_per_run 8 --max_queued_per_key 8 --max_queued 8", "max_queued_per_key: 8 must be below --max_queued"},
           {"--max_queued_per_run 9 --max_queued_per_key 8", "max_queued_per_run: 9 is more than"},
           {"--max_queued_mb_per_key 4 --max_queued_mb 4", "max_queued_mb_per_key: 4 MiB must be below"},
           {"--max_queued_mb_per_key 4 --max_upload_mb 5", "max_upload_mb: 5 is more than --max_queued_mb_per_key"}}) {
    auto refused = testing::RunProcesses(
        {{"/bin/sh", "-c",
          absl::StrCat(Binary("server/lorastep_coordinator"), " --model ", dir, "/none --port 0 --api_keys_file ", keys,
                       " ", flags, " 2>&1")}},
        dir, 60);
    EXPECT_NE(refused[0].exit_code, 0) << flags;
    EXPECT_TRUE(absl::StrContains(refused[0].output, named)) << refused[0].output;
  }
  auto server = StartTinyCoordinator("tenant_share", {"--api_keys_file", keys, "--max_queued_per_key", "2",
                                                      "--max_queued", "3", "--max_queued_per_run", "2",
                                                      "--max_queued_mb_per_key", "8", "--max_queued_mb", "16",
                                                      "--max_upload_mb", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto greedy = TrainerClient::Connect(server->address(), 30, "greedy-key-0123456789");
  auto other = TrainerClient::Connect(server->address(), 30, "other-key-0123456789");
  ASSERT_TRUE(greedy.ok() && other.ok());
  auto g1 = RunSession::Create(greedy->get(), Lora(), 1);
  auto g2 = RunSession::Create(greedy->get(), Lora(), 2);
  auto o = RunSession::Create(other->get(), Lora(), 3);
  ASSERT_TRUE(g1.ok() && g2.ok() && o.ok());
  // A request whose parse may take over 8 MiB: past the key's bytes before it is parsed.
  {
    v1::ForwardRequest huge;
    huge.set_run_id(g1->run_id());
    for (int i = 0; i < 6; ++i) *huge.add_datums() = testing::RlDatum(i, 0, 50000, 96);
    auto r = (*greedy)->Forward(huge);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "max_queued_mb_per_key")) << r.status();
  }
  // The greedy key keeps slow calls in flight on both its runs, as fast as it can.
  v1::ForwardRequest slow;
  for (int i = 0; i < 128; ++i) *slow.add_datums() = testing::RlDatum(i, 0, 200, 96);
  std::atomic<bool> stop{false};
  std::atomic<int> greedy_ok{0}, greedy_refused{0}, greedy_wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      v1::ForwardRequest req = slow;
      req.set_run_id(t % 2 == 0 ? g1->run_id() : g2->run_id());
      while (!stop) {
        auto r = (*greedy)->Forward(req);
        if (r.ok()) {
          ++greedy_ok;
        } else if (r.status().code() == absl::StatusCode::kResourceExhausted &&
                   absl::StartsWith(r.status().message(), "max_queued_per_key: this key has 2 calls in flight")) {
          ++greedy_refused;
        } else {
          ++greedy_wrong;
        }
      }
    });
  }
  // Meanwhile the other key steps: every call admitted (the whole is 3, the greedy key's share 2).
  int other_ok = 0;
  for (int step = 0; step < 6; ++step) {
    auto r = o->TrainStep(Batch(step), Ppo(), Adam());
    EXPECT_TRUE(r.ok()) << r.status();
    other_ok += r.ok();
  }
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(other_ok, 6);
  EXPECT_GE(greedy_ok.load(), 1);
  EXPECT_GE(greedy_refused.load(), 1);
  EXPECT_EQ(greedy_wrong.load(), 0);
}

// A WatchMetrics client that stops reading holds at most --max_watch_backlog records on the
// coordinator: once the transport's window is full and the backlog too, the stream ends
// with RESOURCE_EXHAUSTED naming the first record it dropped, and watching again from
// there gives every later record (none is lost from the run's history).
TEST(BoundsTest, SlowWatcherIsCutOffAndResumesWithoutLoss) {
  auto server = StartTinyCoordinator("watch_bound", {"--max_watch_backlog", "4", "--nojournal"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = TrainerClient::Connect(server->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto run = RunSession::Create(client->get(), Lora(), 1);
  ASSERT_TRUE(run.ok()) << run.status();
  // A watcher that does not read while the steps run, on a channel whose window stays small
  // (no BDP probing): the coordinator's writes stall once a few records are in flight.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4096);
  auto stub = v1::Trainer::NewStub(grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  v1::WatchMetricsRequest req;
  req.set_run_id(run->run_id());
  auto reader = stub->WatchMetrics(&ctx, req);
  constexpr int kSteps = 200;
  for (int i = 0; i < kSteps; ++i) ASSERT_OK(run->TrainStep(Batch(i % 4, 2), Ppo(), Adam()));
  std::vector<int64_t> seen;
  v1::StepRecord record;
  while (reader->Read(&record)) seen.push_back(record.step());
  const grpc::Status ended = reader->Finish();
  ASSERT_EQ(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ended.error_message();
  const std::string marker = "since_step = ";
  const size_t at = ended.error_message().find(marker);
  ASSERT_NE(at, std::string::npos) << ended.error_message();
  const int64_t resume = std::stoll(ended.error_message().substr(at + marker.size()));
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], static_cast<int64_t>(i)) << "records in order, none skipped";
  EXPECT_EQ(resume, static_cast<int64_t>(seen.size())) << "the stream resumes right after the last record it sent";
  EXPECT_LT(resume, kSteps) << "the backlog was cut before the last step";
  std::vector<int64_t> rest;
  v1::WatchMetricsRequest again;
  again.set_run_id(run->run_id());
  again.set_since_step(resume);
  ASSERT_OK((*client)->WatchMetrics(again, [&](const v1::StepRecord& r) {
    rest.push_back(r.step());
    return r.step() < kSteps - 1;
  }));
  ASSERT_EQ(rest.size(), static_cast<size_t>(kSteps - resume));
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i], resume + static_cast<int64_t>(i));
}

}  // namespace
}  // namespace lorastep
