// (g) Checkpoints: save, load, continue is bitwise the same as uninterrupted training; an
// interrupted save leaves the previous checkpoint loadable. Plus the trainer's contracts:
// k ForwardBackward + OptimStep == TrainStep, bad calls change nothing, PEFT export/import.
#include "lib/training/trainer.h"

#include <cstring>


#include "lib/io/digest.h"
#include "lib/io/file_util.h"
#include "lib/model/peft_io.h"
#include "lib/io/safetensors.h"
#include "lib/training/activation_memory.h"
#include "lib/training/micro_batch.h"
#include "lib/status_macros.h"
#include "tests/test_util.h"
#include "tests/torch_test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;
using ::lorastep::testing::StatusIs;

std::string TinyModel(const std::string& dir) {
  ModelConfig c = ModelConfigPreset("tiny").value();
  EXPECT_TRUE(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)).ok());
  return dir + "/model";
}

std::vector<Datum> RlBatch(int step, int64_t vocab) {
  std::vector<Datum> out;
  for (int i = 0; i < 4; ++i) {
    Datum d;
    const int n = 5 + (i * 3 + step) % 6;
    for (int j = 0; j < n; ++j) {
      d.tokens.push_back((i * 7 + j * 3 + step) % vocab);
      d.target_tokens.push_back((i * 5 + j * 11 + step) % vocab);
      d.logprobs.push_back(-4.0f - 0.1f * j);
      d.advantages.push_back(j < 2 ? 0.0f : (i % 2 == 0 ? 1.0f : -0.5f));
    }
    out.push_back(d);
  }
  return out;
}

TrainerOptions Options() {
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.lora.dropout = 0.1;  // exercises the checkpointed dropout RNG
  o.seed = 17;
  o.max_tokens_per_microbatch = 24;
  o.logprob_chunk_tokens = 7;
  return o;
}

LossConfig Ppo() {
  LossConfig l;
  l.kind = LossKind::kPpo;
  return l;
}

AdamWParams Adam() {
  AdamWParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.max_grad_norm = 1.0;
  p.beta2 = 0.98;
  return p;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ScratchDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto base = LoadBaseModel(TinyModel(dir_), ::lorastep::testing::TestDevice().str(),
                              ::lorastep::testing::TestDtypeName());
    ASSERT_TRUE(base.ok()) << base.status();
    base_ = *base;
  }
  std::unique_ptr<Trainer> NewTrainer(TrainerOptions o = Options()) {
    auto t = Trainer::Create(base_, o);
    EXPECT_TRUE(t.ok()) << t.status();
    return std::move(t).value();
  }
  std::string dir_;
  std::shared_ptr<const BaseModel> base_;
};

TEST_F(TrainerTest, SaveLoadContinueIsBitwiseIdenticalToUninterrupted) {
  auto straight = NewTrainer();
  for (int s = 0; s < 4; ++s) ASSERT_OK(straight->TrainStep(RlBatch(s, 96), Ppo(), Adam()));

  auto first = NewTrainer();
  for (int s = 0; s < 2; ++s) ASSERT_OK(first->TrainStep(RlBatch(s, 96), Ppo(), Adam()));
  ASSERT_OK(first->SaveState(dir_ + "/ckpt"));
  auto resumed = NewTrainer();
  ASSERT_OK(resumed->LoadState(dir_ + "/ckpt"));
  EXPECT_EQ(resumed->learner_version(), 2);
  EXPECT_EQ(resumed->AdapterSha256(), first->AdapterSha256());
  for (int s = 2; s < 4; ++s) ASSERT_OK(resumed->TrainStep(RlBatch(s, 96), Ppo(), Adam()));
  EXPECT_EQ(resumed->AdapterSha256(), straight->AdapterSha256());
  // And the adapter really moved (the comparison is not between two untouched adapters).
  EXPECT_NE(straight->AdapterSha256(), NewTrainer()->AdapterSha256());
}

// An autosave in the background: the snapshot is the state of its moment, written after the
// run has trained on (the host copy does not alias the live tensors, which are CPU tensors
// here), and a run resumed from it continues bitwise like one never interrupted.
TEST_F(TrainerTest, SnapshotWrittenLaterHoldsTheStateOfItsMoment) {
  auto straight = NewTrainer();
  for (int s = 0; s < 4; ++s) ASSERT_OK(straight->TrainStep(RlBatch(s, 96), Ppo(), Adam()));

  auto first = NewTrainer();
  for (int s = 0; s < 2; ++s) ASSERT_OK(first->TrainStep(RlBatch(s, 96), Ppo(), Adam()));
  const std::string sha_at_2 = first->AdapterSha256();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const TrainerStateSnapshot> snapshot, first->SnapshotState());
  ASSERT_OK(first->TrainStep(RlBatch(2, 96), Ppo(), Adam()));  // changes every tensor in place
  ASSERT_NE(first->AdapterSha256(), sha_at_2);
  ASSERT_OK(Trainer::WriteStateSnapshot(*snapshot, dir_ + "/later"));
  auto resumed = NewTrainer();
  ASSERT_OK(resumed->LoadState(dir_ + "/later"));
  EXPECT_EQ(resumed->learner_version(), 2);
  EXPECT_EQ(resumed->AdapterSha256(), sha_at_2);
  for (int s = 2; s < 4; ++s) ASSERT_OK(resumed->TrainStep(RlBatch(s, 96), Ppo(), Adam()));
  EXPECT_EQ(resumed->AdapterSha256(), straight->AdapterSha256());
  // A failed write (its parent is a file) says so and leaves nothing.
  ASSERT_OK(WriteStringToFile(dir_ + "/file", "x"));
  EXPECT_FALSE(Trainer::WriteStateSnapshot(*snapshot, dir_ + "/file/ckpt").ok());
}

TEST_F(TrainerTest, InterruptedSaveLeavesThePreviousCheckpointLoadable) {
  auto trainer = NewTrainer();
  ASSERT_OK(trainer->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  ASSERT_OK(trainer->SaveState(dir_ + "/ckpt"));
  const std::string saved_sha = trainer->AdapterSha256();
  ASSERT_OK(trainer->TrainStep(RlBatch(1, 96), Ppo(), Adam()));
  for (const char* stage : {"trainable_written", "files_written", "before_swap"}) {
    auto crash = [stage](const std::string& at) -> absl::Status {
      if (at == stage) return absl::AbortedError(absl::StrCat("simulated crash at ", at));
      return absl::OkStatus();
    };
    EXPECT_THAT(trainer->SaveState(dir_ + "/ckpt", crash),
                StatusIs(absl::StatusCode::kAborted, "simulated crash"));
    auto reader = NewTrainer();
    ASSERT_OK(reader->LoadState(dir_ + "/ckpt"));
    EXPECT_EQ(reader->AdapterSha256(), saved_sha) << stage;
    EXPECT_EQ(reader->learner_version(), 1);
  }
  // A later complete save replaces it (leftover temporary folders do not get in the way).
  ASSERT_OK(trainer->SaveState(dir_ + "/ckpt"));
  auto reader = NewTrainer();
  ASSERT_OK(reader->LoadState(dir_ + "/ckpt"));
  EXPECT_EQ(reader->AdapterSha256(), trainer->AdapterSha256());
}

// Issue 8: SaveState onto an existing folder deleted its contents, and ExportAdapter was not
// atomic. Both now refuse folders lorastep did not write and replace their own atomically.
TEST_F(TrainerTest, ExportAndSaveRefuseForeignFolders) {
  auto trainer = NewTrainer();
  ASSERT_OK(trainer->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  ASSERT_OK(MakeDirectories(dir_ + "/user"));
  ASSERT_OK(WriteStringToFile(dir_ + "/user/data.txt", "keep me"));
  EXPECT_THAT(trainer->SaveState(dir_ + "/user"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "was not written by lorastep"));
  EXPECT_THAT(trainer->ExportAdapter(dir_ + "/user"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "was not written by lorastep"));
  EXPECT_EQ(ReadFileToString(dir_ + "/user/data.txt").value(), "keep me");
  ASSERT_OK(trainer->ExportAdapter(dir_ + "/peft"));
  ASSERT_OK(trainer->TrainStep(RlBatch(1, 96), Ppo(), Adam()));
  ASSERT_OK(trainer->ExportAdapter(dir_ + "/peft"));  // its own folder: replaced
  ASSERT_OK(trainer->SaveState(dir_ + "/peft"));      // lorastep's folder, whatever it held
  auto reader = NewTrainer();
  ASSERT_OK(reader->LoadState(dir_ + "/peft"));
  EXPECT_EQ(reader->AdapterSha256(), trainer->AdapterSha256());
}

TEST_F(TrainerTest, LoadingACorruptCheckpointChangesNothing) {
  auto trainer = NewTrainer();
  ASSERT_OK(trainer->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  ASSERT_OK(trainer->SaveState(dir_ + "/ckpt"));
  ASSERT_OK(WriteStringToFile(dir_ + "/ckpt/optimizer.safetensors", "garbage"));
  auto other = NewTrainer();
  const std::string before = other->AdapterSha256();
  EXPECT_THAT(other->LoadState(dir_ + "/ckpt"), StatusIs(absl::StatusCode::kInvalidArgument, "optimizer.safetensors"));
  EXPECT_EQ(other->AdapterSha256(), before);
  EXPECT_EQ(other->learner_version(), 0);
  TrainerOptions o = Options();
  o.lora.rank = 2;
  EXPECT_THAT(NewTrainer(o)->LoadState(dir_ + "/ckpt"),
              StatusIs(absl::StatusCode::kInvalidArgument, "lora config"));
  // A checkpoint whose trainer_state.json has a malformed field: INVALID_ARGUMENT naming it,
  // and the adapter is untouched (the values were staged, never committed).
  ASSERT_OK(trainer->SaveState(dir_ + "/ckpt2"));
  ASSERT_OK_AND_ASSIGN(std::string json, ReadFileToString(dir_ + "/ckpt2/trainer_state.json"));
  const size_t at = json.find("\"optimizer_steps\": 1");
  ASSERT_NE(at, std::string::npos) << json;
  json.replace(at, std::string("\"optimizer_steps\": 1").size(), "\"optimizer_steps\": \"seven\"");
  ASSERT_OK(WriteStringToFile(dir_ + "/ckpt2/trainer_state.json", json));
  EXPECT_THAT(other->LoadState(dir_ + "/ckpt2"),
              StatusIs(absl::StatusCode::kInvalidArgument, "optimizer_steps: must be an integer"));
  EXPECT_EQ(other->AdapterSha256(), before);
  EXPECT_EQ(other->learner_version(), 0);
  // Issue 26, defect 7: a trainer_state.json that is not an object (it answered INTERNAL), a
  // tensor holding NaN (loaded, and Forward returned NaN), and trainable weights that differ
  // from the fp32 master copy (the next step silently reverted to the master) are refused.
  ASSERT_OK(trainer->SaveState(dir_ + "/ckpt3"));
  ASSERT_OK(WriteStringToFile(dir_ + "/ckpt3/trainer_state.json", "[1,2,3]"));
  EXPECT_THAT(other->LoadState(dir_ + "/ckpt3"),
              StatusIs(absl::StatusCode::kInvalidArgument, "trainer_state.json: not a JSON object"));
  // Overwrites the first 4 bytes of tensor `name` in the safetensors file `path`.
  auto poke = [](const std::string& path, const std::string& name, const std::string& bytes) -> absl::Status {
    size_t offset = 0;
    {
      LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
      const uint8_t* first = nullptr;
      for (const auto& e : file.entries()) first = first == nullptr || e.data < first ? e.data : first;
      LORASTEP_ASSIGN_OR_RETURN(const SafetensorsEntry* entry, file.Find(name));
      LORASTEP_ASSIGN_OR_RETURN(std::string all, ReadFileToString(path));
      uint64_t header = 0;
      std::memcpy(&header, all.data(), 8);
      offset = 8 + header + static_cast<size_t>(entry->data - first);
    }
    LORASTEP_ASSIGN_OR_RETURN(std::string all, ReadFileToString(path));
    all.replace(offset, bytes.size(), bytes);
    return WriteStringToFile(path, all);
  };
  const std::string first_param = trainer->adapter().parameters()[0].name;
  const std::string nan("\x00\x00\xc0\x7f", 4);  // a float32 NaN, little-endian
  struct Case {
    const char* file;
    std::string tensor, bytes, error;
  };
  for (const Case& c : {Case{"trainable", first_param, nan, "holds non-finite values"},
                        Case{"optimizer", first_param + ".exp_avg_sq", nan, "holds non-finite values"},
                        Case{"trainable", first_param, std::string("\x01\x00\x80\x3f", 4),
                             "differs from its fp32 master copy"}}) {
    SCOPED_TRACE(c.error);
    ASSERT_OK(trainer->SaveState(dir_ + "/ckpt4"));
    ASSERT_OK(poke(absl::StrCat(dir_, "/ckpt4/", c.file, ".safetensors"), c.tensor, c.bytes));
    EXPECT_THAT(other->LoadState(dir_ + "/ckpt4"), StatusIs(absl::StatusCode::kInvalidArgument, c.error));
    EXPECT_EQ(other->AdapterSha256(), before);
    ASSERT_OK(RemoveAll(dir_ + "/ckpt4"));
  }
}

TEST_F(TrainerTest, ForwardBackwardCallsThenOptimStepEqualOneTrainStep) {
  TrainerOptions o = Options();
  o.lora.dropout = 0;  // the split changes dropout draws' order; compare the math alone
  auto whole = NewTrainer(o);
  auto parts = NewTrainer(o);
  std::vector<Datum> batch = RlBatch(3, 96);
  LossConfig loss = Ppo();
  loss.normalization = LossNormalization::kSum;  // sums split exactly across calls
  ASSERT_OK_AND_ASSIGN(OptimStepResult a, whole->TrainStep(batch, loss, Adam()));
  ASSERT_OK(parts->ForwardBackward({batch[0], batch[1]}, loss));
  ASSERT_OK(parts->ForwardBackward({batch[2], batch[3]}, loss));
  ASSERT_OK_AND_ASSIGN(OptimStepResult b, parts->OptimStep(Adam()));
  EXPECT_NEAR(a.metrics.Get("grad_norm:sum"), b.metrics.Get("grad_norm:sum"),
              ::lorastep::testing::Tol(1e-6) * a.metrics.Get("grad_norm:sum"));
  auto& pa = whole->adapter().parameters();
  auto& pb = parts->adapter().parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LT(::lorastep::testing::MaxAbsDiff(pa[i].value, pb[i].value),
              ::lorastep::testing::Tol(1e-6)) << pa[i].name;
  }
  EXPECT_EQ(a.learner_version, 1);
  EXPECT_GT(a.metrics.Get("tokens_loss:sum"), 0);
  EXPECT_TRUE(a.metrics.Has("pg_clipfrac:mean"));
  EXPECT_TRUE(a.metrics.Has("time_backward_s:sum"));
  EXPECT_TRUE(a.metrics.Has("time_digest_s:sum"));
  EXPECT_EQ(a.adapter_sha256.size(), 64u);
}

// A call cancelled inside its first micro-batch, between layers in forward or as backward
// passes a layer, stops there: CANCELLED naming the micro-batch, nothing applied (adapter,
// learner version, accumulated gradients), and the next call trains as if it had not happened.
TEST_F(TrainerTest, CancelledInsideAMicroBatchStopsBetweenLayersAndAppliesNothing) {
  const std::vector<Datum> batch = RlBatch(3, 96);
  auto reference = NewTrainer();
  ASSERT_OK_AND_ASSIGN(OptimStepResult expected, reference->TrainStep(batch, Ppo(), Adam()));
  // Asked before the micro-batch (1), before each of the 2 layers (2, 3), then once per layer
  // in backward (4, 5): stopping at the 2nd ask stops in forward, at the 4th in backward.
  for (const int stop_at : {2, 3, 4, 5}) {
    SCOPED_TRACE(stop_at);
    auto trainer = NewTrainer();
    const std::string before = trainer->AdapterSha256();
    int asked = 0;
    BatchOptions options;
    options.cancelled = [&] { return ++asked >= stop_at; };
    EXPECT_THAT(trainer->TrainStep(batch, Ppo(), Adam(), options).status(),
                StatusIs(absl::StatusCode::kCancelled, "during micro-batch 1 of 2; nothing was applied"));
    EXPECT_EQ(asked, stop_at + 1) << "asked once more by the catch, then no more";
    EXPECT_EQ(trainer->AdapterSha256(), before);
    EXPECT_EQ(trainer->learner_version(), 0);
    EXPECT_EQ(trainer->pending_backward_calls(), 0);
    for (const Parameter& p : trainer->adapter().parameters()) {
      EXPECT_EQ(p.main_grad.abs().max().item<double>(), 0.0) << p.name;
    }
    ASSERT_OK_AND_ASSIGN(OptimStepResult next, trainer->TrainStep(batch, Ppo(), Adam()));
    EXPECT_EQ(next.adapter_sha256, expected.adapter_sha256) << "the step after equals a first step";
  }
  // Forward alone stops too.
  auto forward = NewTrainer();
  BatchOptions stop;
  stop.cancelled = [] { return true; };
  EXPECT_THAT(forward->Forward(batch, stop).status(), StatusIs(absl::StatusCode::kCancelled, "before micro-batch 1"));
}

// A TrainStep returns no log-probs, so its head scores only the loss-bearing positions
// (here the first two of each datum are prompt, and one datum has no loss-bearing position
// at all, alone in its micro-batch); ForwardBackward scores every position for the log-probs
// it returns. The update is the same.
TEST_F(TrainerTest, TrainStepScoresOnlyLossBearingPositions) {
  TrainerOptions o = Options();
  o.lora.dropout = 0;
  for (bool packed : {true, false}) {
    o.pack_sequences = packed;
    auto step = NewTrainer(o);
    auto split = NewTrainer(o);
    std::vector<Datum> batch = RlBatch(1, 96);
    Datum prompt_only = batch[0];
    prompt_only.tokens.resize(20, 3);
    prompt_only.target_tokens.resize(20, 4);
    prompt_only.logprobs.resize(20, -1.0f);
    prompt_only.advantages.assign(20, 0.0f);
    batch.push_back(prompt_only);
    double positions = 0, bearing = 0;
    for (const Datum& d : batch) {
      positions += static_cast<double>(d.tokens.size());
      for (size_t i = 0; i < d.tokens.size(); ++i) bearing += LossMask(d, i) != 0 ? 1 : 0;
    }
    ASSERT_LT(bearing, positions - 20);
    ASSERT_OK_AND_ASSIGN(OptimStepResult a, step->TrainStep(batch, Ppo(), Adam()));
    ASSERT_OK_AND_ASSIGN(ForwardBackwardResult fb, split->ForwardBackward(batch, Ppo()));
    ASSERT_OK_AND_ASSIGN(OptimStepResult b, split->OptimStep(Adam()));
    EXPECT_EQ(a.metrics.Get("tokens_scored:sum"), bearing) << packed;
    EXPECT_EQ(fb.metrics.Get("tokens_scored:sum"), positions) << packed;
    ASSERT_EQ(fb.logprobs.size(), batch.size());
    EXPECT_EQ(fb.logprobs.back().size(), 20u);
    for (const char* key : {"loss:sum", "grad_norm:sum", "pg_clipfrac:mean"}) {
      const double x = a.metrics.Get(key), y = key == std::string("grad_norm:sum") ? b.metrics.Get(key)
                                                                                    : fb.metrics.Get(key);
      EXPECT_NEAR(x, y, ::lorastep::testing::Tol(1e-6) * std::max(1.0, std::abs(y))) << key << " packed " << packed;
    }
    auto& pa = step->adapter().parameters();
    auto& pb = split->adapter().parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_LT(::lorastep::testing::MaxAbsDiff(pa[i].value, pb[i].value), ::lorastep::testing::Tol(1e-6))
          << pa[i].name << " packed " << packed;
    }
  }
}

// Packed micro-batches (datums back to back, attention per sequence) and padded ones give
// the same log-probs, loss and update on a batch of mixed lengths; packing pads nothing.
TEST_F(TrainerTest, PackedAndPaddedMicroBatchesAgree) {
  TrainerOptions o = Options();
  o.lora.dropout = 0;  // the layouts draw dropout masks over different shapes
  o.max_tokens_per_microbatch = 40;  // lengths 10, 10, 7, 7 in one micro-batch: padding when padded
  TrainerOptions padded_options = o;
  padded_options.pack_sequences = false;
  auto packed = NewTrainer(o);
  auto padded = NewTrainer(padded_options);
  const std::vector<Datum> batch = RlBatch(2, 96);
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult fa, packed->Forward(batch));
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult fb, padded->Forward(batch));
  ASSERT_EQ(fa.logprobs.size(), fb.logprobs.size());
  for (size_t d = 0; d < fa.logprobs.size(); ++d) {
    ASSERT_EQ(fa.logprobs[d].size(), batch[d].tokens.size());
    for (size_t i = 0; i < fa.logprobs[d].size(); ++i) {
      EXPECT_NEAR(fa.logprobs[d][i], fb.logprobs[d][i], ::lorastep::testing::Tol(1e-5)) << d << " " << i;
    }
  }
  ASSERT_OK_AND_ASSIGN(OptimStepResult a, packed->TrainStep(batch, Ppo(), Adam()));
  ASSERT_OK_AND_ASSIGN(OptimStepResult b, padded->TrainStep(batch, Ppo(), Adam()));
  EXPECT_NEAR(a.metrics.Get("loss:sum"), b.metrics.Get("loss:sum"), ::lorastep::testing::Tol(1e-5));
  EXPECT_EQ(a.metrics.Get("tokens_physical:sum"), a.metrics.Get("tokens_nonpadding:sum"));
  EXPECT_GT(b.metrics.Get("tokens_physical:sum"), b.metrics.Get("tokens_nonpadding:sum"));
  auto& pa = packed->adapter().parameters();
  auto& pb = padded->adapter().parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LT(::lorastep::testing::MaxAbsDiff(pa[i].value, pb[i].value), ::lorastep::testing::Tol(1e-5)) << pa[i].name;
  }
}

TEST_F(TrainerTest, BadCallsChangeNothing) {
  auto clean = NewTrainer();
  auto probed = NewTrainer();
  ASSERT_OK(clean->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  ASSERT_OK(probed->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  std::vector<Datum> bad = RlBatch(1, 96);
  bad[2].advantages[3] = NAN;
  EXPECT_THAT(probed->TrainStep(bad, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[2].advantages[3]: not finite"));
  AdamWParams bad_adam = Adam();
  bad_adam.beta2 = 1.5;
  EXPECT_THAT(probed->TrainStep(RlBatch(1, 96), Ppo(), bad_adam),
              StatusIs(absl::StatusCode::kInvalidArgument, "adamw.beta2"));
  LossConfig bad_loss = Ppo();
  bad_loss.clip_eps_low = 2;
  EXPECT_THAT(probed->ForwardBackward(RlBatch(1, 96), bad_loss),
              StatusIs(absl::StatusCode::kInvalidArgument, "loss.clip_eps_low"));
  std::vector<Datum> positive = RlBatch(1, 96);
  positive[1].logprobs[2] = 0.5f;  // a sampler log-probability above 0
  EXPECT_THAT(probed->TrainStep(positive, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "datums[1].logprobs[2]: 0.5 > 0"));
  std::vector<Datum> long_one = RlBatch(1, 96);
  const int64_t positions = probed->base().config.max_position_embeddings;
  long_one[0].tokens.assign(positions + 1, 1);
  long_one[0].target_tokens.assign(positions + 1, 1);
  long_one[0].logprobs.assign(positions + 1, -1.0f);
  long_one[0].advantages.assign(positions + 1, 1.0f);
  EXPECT_THAT(probed->TrainStep(long_one, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "exceeds the model's max_position_embeddings"));
  AdamWParams huge_lr = Adam();
  huge_lr.lr = 1e30;
  EXPECT_THAT(probed->TrainStep(RlBatch(1, 96), Ppo(), huge_lr),
              StatusIs(absl::StatusCode::kInvalidArgument, "adamw.lr"));
  std::vector<Datum> oov = RlBatch(1, 96);
  oov[0].tokens[0] = 96;
  EXPECT_THAT(probed->Forward(oov), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  // Advantages whose gradient overflows (3e38) are refused before any work; they used to get
  // as far as the optimizer's non-finite refusal (adamw_test covers that refusal).
  std::vector<Datum> huge = RlBatch(1, 96);
  for (auto& d : huge) for (auto& a : d.advantages) a = a != 0 ? 3e38f : 0.0f;
  LossConfig unnormalized = Ppo();  // sum: no 1/tokens to pull the gradient back into range
  unnormalized.normalization = LossNormalization::kSum;
  EXPECT_THAT(probed->TrainStep(huge, unnormalized, Adam()),
              StatusIs(absl::StatusCode::kInvalidArgument, "advantages"));
  EXPECT_EQ(probed->pending_backward_calls(), 0);
  EXPECT_EQ(probed->learner_version(), 1);
  ASSERT_OK(clean->TrainStep(RlBatch(1, 96), Ppo(), Adam()));
  ASSERT_OK(probed->TrainStep(RlBatch(1, 96), Ppo(), Adam()));
  EXPECT_EQ(clean->AdapterSha256(), probed->AdapterSha256());
}

// Trainer::JointTrainStep (co-scheduling, issue 30): runs that differ in rank, alpha, target
// modules (the LM head included) and dropout, trained together for two steps, each equal the
// same run trained alone: loss, grad_norm and every parameter. A call refused at admission
// (a bad batch, a run twice) or by its optimizer (a staged update that fails) fails alone
// and changes nothing of its run; the others commit.
TEST_F(TrainerTest, JointTrainStepEqualsEachRunAlone) {
  struct Spec {
    int64_t rank;
    double alpha, dropout;
    std::vector<std::string> targets;
  };
  // Run 1's dropout sends the projections it has branches on (q/k/v, down) through the
  // per-segment path; the rest run through SegmentedLoraLinear, gate/up as one packed group.
  const std::vector<Spec> specs{{4, 8, 0.0, {"all-linear"}},
                                {2, 4, 0.1, {"q_proj", "v_proj", "down_proj"}},
                                {8, 8, 0.0, {"o_proj", "gate_proj", "up_proj", "lm_head"}}};
  auto options_of = [&](size_t i) {
    TrainerOptions o = Options();
    o.lora.rank = specs[i].rank, o.lora.alpha = specs[i].alpha, o.lora.dropout = specs[i].dropout;
    o.lora.target_modules = specs[i].targets;
    o.seed = 17 + i;
    return o;
  };
  std::vector<std::unique_ptr<Trainer>> solo, joint;
  for (size_t i = 0; i < specs.size(); ++i) {
    solo.push_back(NewTrainer(options_of(i)));
    // Run 2 leads step 1's call list: its bound on staged optimizer state (one byte) has
    // every run staged, checked and committed in a batch of its own; step 0 stages all three
    // at once under run 0's default bound.
    TrainerOptions o = options_of(i);
    if (i == 2) o.joint_optimizer_stage_bytes = 1;
    joint.push_back(NewTrainer(o));
  }
  // CPU fp32: 1e-6. CUDA: the joint row's GEMMs have other row counts, so cuBLAS picks other
  // kernels; this batch's PPO loss is a small sum of cancelling terms, where that rounding
  // shows at ~1e-5 of it (measured on the H200, fp32).
  const double tol = ::lorastep::testing::Tol(::lorastep::testing::TestDevice().is_cuda() ? 1e-4 : 1e-6);
  // Step 0: the trainers' micro-batches. Step 1: micro-batches of at most 16 tokens, two or
  // three per run. A run appears once per row, and the budget holds all three runs' parts,
  // so the rows are as many as the most micro-batches of a run.
  for (int step = 0; step < 2; ++step) {
    const int64_t max_tokens = step == 0 ? 0 : 16;
    std::vector<std::vector<Datum>> batches;
    for (size_t i = 0; i < specs.size(); ++i) batches.push_back(RlBatch(step * 3 + static_cast<int>(i), 96));
    const LossConfig loss = Ppo();
    std::vector<JointTrainCall> calls;
    for (size_t k = 0; k < specs.size(); ++k) {
      const size_t i = step == 0 ? k : specs.size() - 1 - k;
      calls.push_back({joint[i].get(), &batches[i], &loss, Adam(), max_tokens});
    }
    auto together = Trainer::JointTrainStep(calls);
    ASSERT_EQ(together.size(), specs.size());
    if (step == 1) std::reverse(together.begin(), together.end());  // back in run order
    double most_micro_batches = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      ASSERT_TRUE(together[i].ok()) << together[i].status();
      most_micro_batches = std::max(most_micro_batches, together[i]->metrics.Get("micro_batches:sum"));
    }
    if (step == 1) {
      EXPECT_EQ(most_micro_batches, 3.0);
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      const std::string what = "step " + std::to_string(step) + " run " + std::to_string(i);
      BatchOptions own;
      own.max_tokens_per_microbatch = max_tokens;
      ASSERT_OK_AND_ASSIGN(OptimStepResult alone, solo[i]->TrainStep(batches[i], loss, Adam(), own));
      EXPECT_EQ(together[i]->metrics.Get("co_scheduled_rows:sum"), most_micro_batches) << what;
      EXPECT_EQ(together[i]->metrics.Get("micro_batches:sum"), alone.metrics.Get("micro_batches:sum")) << what;
      EXPECT_EQ(together[i]->adapter_sha256, joint[i]->AdapterSha256()) << what;  // hashed with the others'
      EXPECT_TRUE(together[i]->metrics.Has("time_digest_s:sum")) << what;
      ASSERT_TRUE(together[i].ok()) << what << ": " << together[i].status();
      const Metrics& got = together[i]->metrics;
      EXPECT_NEAR(got.Get("loss:sum"), alone.metrics.Get("loss:sum"), tol * std::abs(alone.metrics.Get("loss:sum")))
          << what;
      EXPECT_NEAR(got.Get("grad_norm:sum"), alone.metrics.Get("grad_norm:sum"), tol * alone.metrics.Get("grad_norm:sum"))
          << what;
      EXPECT_EQ(got.Get("co_scheduled_runs:max"), 3.0) << what;
      EXPECT_EQ(got.Get("tokens_loss:sum"), alone.metrics.Get("tokens_loss:sum")) << what;
      EXPECT_EQ(together[i]->learner_version, alone.learner_version) << what;
    }
  }
  // Parameters (the adapter a run exports) after both steps: 1e-6 on CPU. On CUDA 10x the
  // step's tolerance: the joint row's GEMMs have other shapes (and alone, gate/up folds the
  // branch into the frozen GEMM), and AdamW's division by sqrt(v) lifts that rounding on the
  // smallest gradient elements (H200 fp32: up to 3.2e-4 of a tensor).
  const double param_tol = ::lorastep::testing::TestDevice().is_cuda() ? 10 * tol : tol;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& a = joint[i]->adapter().parameters();
    const auto& b = solo[i]->adapter().parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t p = 0; p < a.size(); ++p) {
      EXPECT_LT(::lorastep::testing::RelErr(a[p].value, b[p].value), param_tol) << "run " << i << " " << a[p].name;
    }
  }
  // Isolation: run 1's batch is refused by name, run 0 appears twice (the second refused),
  // and a fourth run's optimizer fails its staged update; runs 0 and 2 commit.
  // Its staged update fails as an allocation would (the fault point the optimizer passes).
  class FailStage : public FaultPoints {
   public:
    absl::Status At(absl::string_view point) override {
      return point == "AdamWStage" ? absl::ResourceExhaustedError("injected") : absl::OkStatus();
    }
  } fail_stage;
  TrainerOptions failing = options_of(2);
  failing.faults = &fail_stage;
  auto fourth = NewTrainer(failing);
  std::vector<Datum> oov = RlBatch(7, 96);
  oov[0].tokens[0] = 96;
  const std::vector<Datum> good = RlBatch(8, 96);
  const LossConfig loss = Ppo();
  const std::string sha1 = joint[1]->AdapterSha256(), sha4 = fourth->AdapterSha256();
  const int64_t v0 = joint[0]->learner_version(), v1 = joint[1]->learner_version();
  const auto mixed = Trainer::JointTrainStep({{joint[0].get(), &good, &loss, Adam(), 0},
                                              {joint[1].get(), &oov, &loss, Adam(), 0},
                                              {joint[0].get(), &good, &loss, Adam(), 0},
                                              {fourth.get(), &good, &loss, Adam(), 0},
                                              {joint[2].get(), &good, &loss, Adam(), 0}});
  ASSERT_EQ(mixed.size(), 5u);
  EXPECT_TRUE(mixed[0].ok()) << mixed[0].status();
  EXPECT_THAT(mixed[1].status(), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  EXPECT_THAT(mixed[2].status(), StatusIs(absl::StatusCode::kInvalidArgument, "once per step"));
  EXPECT_THAT(mixed[3].status(), StatusIs(absl::StatusCode::kResourceExhausted, "staged update"));
  EXPECT_TRUE(mixed[4].ok()) << mixed[4].status();
  EXPECT_EQ(joint[0]->learner_version(), v0 + 1);
  EXPECT_EQ(joint[1]->learner_version(), v1);
  EXPECT_EQ(joint[1]->AdapterSha256(), sha1);
  EXPECT_EQ(fourth->learner_version(), 0);
  EXPECT_EQ(fourth->pending_backward_calls(), 0);
  EXPECT_EQ(fourth->AdapterSha256(), sha4);
  EXPECT_EQ(mixed[0]->metrics.Get("co_scheduled_runs:max"), 3.0);  // runs 0, 2 and the failing fourth

  // The activation budget bounds a row: at a budget one run's batch fits and no two do, each
  // run's micro-batch takes a row of its own.
  const ModelConfig& config = joint[0]->base().config;
  int64_t budget = 0;
  std::vector<std::vector<Datum>> batches;
  for (size_t i = 0; i < specs.size(); ++i) {
    batches.push_back(RlBatch(20 + static_cast<int>(i), 96));
    std::vector<int64_t> lengths;
    for (const Datum& d : batches.back()) lengths.push_back(static_cast<int64_t>(d.tokens.size()));
    budget = std::max(budget, static_cast<int64_t>(EstimatePackedActivationBytes(
                                  config, joint[0]->base().shard, lengths, /*backward=*/true,
                                  static_cast<int64_t>(c10::elementSize(joint[0]->base().dtype)),
                                  Options().logprob_chunk_tokens, LayerRecompute::kNone, /*mlp_activation_kept=*/true)));
  }
  std::vector<std::unique_ptr<Trainer>> bounded;
  std::vector<JointTrainCall> calls;
  for (size_t i = 0; i < specs.size(); ++i) {
    TrainerOptions o = options_of(i);
    o.max_activation_bytes = budget;
    bounded.push_back(NewTrainer(o));
    calls.push_back({bounded.back().get(), &batches[i], &loss, Adam(), /*max_tokens_per_microbatch=*/1 << 20});
  }
  const auto rows = Trainer::JointTrainStep(calls);
  for (size_t i = 0; i < specs.size(); ++i) {
    ASSERT_TRUE(rows[i].ok()) << rows[i].status();
    EXPECT_EQ(rows[i]->metrics.Get("co_scheduled_rows:sum"), 3.0) << "run " << i;
    EXPECT_EQ(rows[i]->metrics.Get("co_scheduled_runs:max"), 3.0) << "run " << i;
  }

  // Rows evened out: four runs of one batch's length at a budget three of them fit take two
  // rows of two runs (packed up to the budget they would be three and one).
  {
    int64_t tokens = 0;
    std::vector<int64_t> lengths;
    for (const Datum& d : batches[0]) lengths.push_back(static_cast<int64_t>(d.tokens.size())), tokens += lengths.back();
    auto need = [&](int runs) {
      std::vector<int64_t> all;
      for (int i = 0; i < runs; ++i) all.insert(all.end(), lengths.begin(), lengths.end());
      return EstimatePackedActivationBytes(config, joint[0]->base().shard, all, /*backward=*/true,
                                           static_cast<int64_t>(c10::elementSize(joint[0]->base().dtype)),
                                           Options().logprob_chunk_tokens, LayerRecompute::kNone,
                                           /*mlp_activation_kept=*/true);
    };
    std::vector<std::unique_ptr<Trainer>> four;
    std::vector<JointTrainCall> even_calls;
    for (size_t i = 0; i < 4; ++i) {
      TrainerOptions o = options_of(i % specs.size());
      o.max_activation_bytes = static_cast<int64_t>((need(3) + need(4)) / 2);
      four.push_back(NewTrainer(o));
      even_calls.push_back({four.back().get(), &batches[0], &loss, Adam(), /*max_tokens_per_microbatch=*/1 << 20});
    }
    const auto even = Trainer::JointTrainStep(even_calls);
    for (size_t i = 0; i < even.size(); ++i) {
      ASSERT_TRUE(even[i].ok()) << even[i].status();
      EXPECT_EQ(even[i]->metrics.Get("co_scheduled_rows:sum"), 2.0) << "run " << i;
      EXPECT_EQ(even[i]->metrics.Get("co_scheduled_row_tokens:max"), 2.0 * static_cast<double>(tokens)) << "run " << i;
    }
  }

  // Cancellation between rows: run 1 asks to stop after its first micro-batch; it is
  // CANCELLED with nothing applied (its gradients so far dropped), and run 0 steps.
  auto keeps = NewTrainer(options_of(0)), stops = NewTrainer(options_of(2));
  const std::string stops_sha = stops->AdapterSha256();
  int asked = 0;
  std::vector<JointTrainCall> cancelling{{keeps.get(), &batches[0], &loss, Adam(), 16},
                                         {stops.get(), &batches[1], &loss, Adam(), 16}};
  cancelling[1].cancelled = [&] { return ++asked > 1; };
  const auto stopped = Trainer::JointTrainStep(cancelling);
  ASSERT_TRUE(stopped[0].ok()) << stopped[0].status();
  EXPECT_EQ(keeps->learner_version(), 1);
  EXPECT_THAT(stopped[1].status(), StatusIs(absl::StatusCode::kCancelled, "before micro-batch 2 of"));
  EXPECT_EQ(stops->learner_version(), 0);
  EXPECT_EQ(stops->pending_backward_calls(), 0);
  EXPECT_EQ(stops->AdapterSha256(), stops_sha);
  for (const Parameter& p : stops->adapter().parameters()) {
    EXPECT_EQ(p.main_grad.abs().max().item<double>(), 0.0) << p.name;
  }
}

// JointForward: three runs' Forward calls (different ranks and targets, one with dropout,
// which a forward does not apply) as joint rows give each run's Forward alone: log-probs and
// entropy within 1e-6 on CPU; nothing changes; a refused and a cancelled call fail alone.
TEST_F(TrainerTest, JointForwardEqualsEachRunsForward) {
  const std::vector<LoraConfig> loras = [] {
    std::vector<LoraConfig> out(3);
    out[0].rank = 4, out[0].alpha = 8, out[0].target_modules = {"all-linear"};
    out[1].rank = 2, out[1].alpha = 4, out[1].dropout = 0.1, out[1].target_modules = {"q_proj", "v_proj", "lm_head"};
    out[2].rank = 8, out[2].alpha = 8, out[2].target_modules = {"o_proj", "gate_proj", "up_proj", "down_proj"};
    return out;
  }();
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::vector<std::vector<Datum>> batches;
  for (size_t i = 0; i < loras.size(); ++i) {
    TrainerOptions o = Options();
    o.lora = loras[i];
    o.seed = 31 + i;
    trainers.push_back(NewTrainer(o));
    ASSERT_OK(trainers.back()->TrainStep(RlBatch(40 + static_cast<int>(i), 96), Ppo(), Adam()).status());  // B != 0
    batches.push_back(RlBatch(50 + static_cast<int>(i), 96));
  }
  std::vector<ForwardBackwardResult> alone;
  std::vector<std::string> shas;
  for (size_t i = 0; i < loras.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(ForwardBackwardResult r, trainers[i]->Forward(batches[i]));
    alone.push_back(r);
    shas.push_back(trainers[i]->AdapterSha256());
  }
  std::vector<JointForwardCall> calls;
  for (size_t i = 0; i < loras.size(); ++i) calls.push_back({trainers[i].get(), &batches[i], nullptr});
  const auto together = Trainer::JointForward(calls);
  const double tol = ::lorastep::testing::Tol(1e-6);
  for (size_t i = 0; i < loras.size(); ++i) {
    ASSERT_TRUE(together[i].ok()) << together[i].status();
    const ForwardBackwardResult& got = *together[i];
    ASSERT_EQ(got.logprobs.size(), alone[i].logprobs.size());
    for (size_t d = 0; d < got.logprobs.size(); ++d) {
      ASSERT_EQ(got.logprobs[d].size(), alone[i].logprobs[d].size());
      for (size_t p = 0; p < got.logprobs[d].size(); ++p) {
        EXPECT_NEAR(got.logprobs[d][p], alone[i].logprobs[d][p], tol * std::abs(alone[i].logprobs[d][p]))
            << "run " << i << " datum " << d << " position " << p;
      }
    }
    EXPECT_NEAR(got.metrics.Get("entropy:mean"), alone[i].metrics.Get("entropy:mean"),
                tol * alone[i].metrics.Get("entropy:mean"));
    EXPECT_EQ(got.metrics.Get("tokens_nonpadding:sum"), alone[i].metrics.Get("tokens_nonpadding:sum"));
    EXPECT_EQ(got.metrics.Get("co_scheduled_runs:max"), 3.0);
    EXPECT_EQ(trainers[i]->AdapterSha256(), shas[i]);
    EXPECT_EQ(trainers[i]->learner_version(), 1);
  }
  // A refused batch and a cancelled call fail alone.
  std::vector<Datum> oov = batches[1];
  oov[0].tokens[0] = 96;
  std::vector<JointForwardCall> mixed{{trainers[0].get(), &batches[0], nullptr},
                                      {trainers[1].get(), &oov, nullptr},
                                      {trainers[2].get(), &batches[2], [] { return true; }}};
  const auto outcome = Trainer::JointForward(mixed);
  ASSERT_TRUE(outcome[0].ok()) << outcome[0].status();
  // Its row now holds it alone: on CUDA the GEMMs' rounding depends on the row's length.
  ASSERT_EQ(outcome[0]->logprobs.size(), together[0]->logprobs.size());
  for (size_t d = 0; d < together[0]->logprobs.size(); ++d) {
    ASSERT_EQ(outcome[0]->logprobs[d].size(), together[0]->logprobs[d].size());
    for (size_t p = 0; p < together[0]->logprobs[d].size(); ++p) {
      EXPECT_NEAR(outcome[0]->logprobs[d][p], together[0]->logprobs[d][p], tol * std::abs(together[0]->logprobs[d][p]));
    }
  }
  EXPECT_THAT(outcome[1].status(), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  EXPECT_THAT(outcome[2].status(), StatusIs(absl::StatusCode::kCancelled, "before micro-batch 1 of"));
}

// JointForwardBackward: three runs' ForwardBackward calls as joint rows, then each run's
// OptimStep, give each run's ForwardBackward + OptimStep alone (log-probs and loss within 1e-6
// on CPU, grad_norm likewise); the gradients wait in each run's buffers; a refused call
// changes nothing of its run. No run has a head LoRA, so each row's runs share one head pass
// (the other joint tests have a run with one: one head per run).
TEST_F(TrainerTest, JointForwardBackwardThenOptimStepEqualsEachRunAlone) {
  std::vector<LoraConfig> loras(3);
  loras[0].rank = 4, loras[0].alpha = 8, loras[0].target_modules = {"all-linear"};
  loras[1].rank = 2, loras[1].alpha = 4, loras[1].dropout = 0.1, loras[1].target_modules = {"q_proj", "v_proj"};
  loras[2].rank = 8, loras[2].alpha = 8, loras[2].target_modules = {"o_proj", "gate_proj"};
  std::vector<std::unique_ptr<Trainer>> solo, joint;
  for (size_t i = 0; i < loras.size(); ++i) {
    TrainerOptions o = Options();
    o.lora = loras[i];
    o.seed = 61 + i;
    solo.push_back(NewTrainer(o));
    joint.push_back(NewTrainer(o));
  }
  std::vector<std::vector<Datum>> batches;
  for (size_t i = 0; i < loras.size(); ++i) batches.push_back(RlBatch(70 + static_cast<int>(i), 96));
  const LossConfig loss = Ppo();
  std::vector<JointTrainCall> calls;
  for (size_t i = 0; i < loras.size(); ++i) calls.push_back({joint[i].get(), &batches[i], &loss, AdamWParams{}, 0});
  const auto together = Trainer::JointForwardBackward(calls);
  const double tol = ::lorastep::testing::Tol(1e-6);
  for (size_t i = 0; i < loras.size(); ++i) {
    const std::string what = "run " + std::to_string(i);
    ASSERT_TRUE(together[i].ok()) << together[i].status();
    ASSERT_OK_AND_ASSIGN(ForwardBackwardResult alone, solo[i]->ForwardBackward(batches[i], loss));
    EXPECT_EQ(joint[i]->pending_backward_calls(), 1) << what;
    EXPECT_NEAR(together[i]->metrics.Get("loss:sum"), alone.metrics.Get("loss:sum"),
                tol * std::abs(alone.metrics.Get("loss:sum"))) << what;
    EXPECT_EQ(together[i]->metrics.Get("co_scheduled_runs:max"), 3.0) << what;
    ASSERT_EQ(together[i]->logprobs.size(), alone.logprobs.size()) << what;
    for (size_t d = 0; d < alone.logprobs.size(); ++d) {
      ASSERT_EQ(together[i]->logprobs[d].size(), alone.logprobs[d].size()) << what;
      for (size_t p = 0; p < alone.logprobs[d].size(); ++p) {
        EXPECT_NEAR(together[i]->logprobs[d][p], alone.logprobs[d][p], tol * std::abs(alone.logprobs[d][p])) << what;
      }
    }
    ASSERT_OK_AND_ASSIGN(OptimStepResult got, joint[i]->OptimStep(Adam()));
    ASSERT_OK_AND_ASSIGN(OptimStepResult want, solo[i]->OptimStep(Adam()));
    EXPECT_NEAR(got.metrics.Get("grad_norm:sum"), want.metrics.Get("grad_norm:sum"),
                tol * want.metrics.Get("grad_norm:sum")) << what;
  }
  // A refused call (a token outside the vocabulary) changes nothing of its run; the others
  // accumulate.
  std::vector<Datum> oov = batches[1];
  oov[0].tokens[0] = 96;
  calls[1].datums = &oov;
  const auto mixed = Trainer::JointForwardBackward(calls);
  EXPECT_TRUE(mixed[0].ok()) << mixed[0].status();
  EXPECT_THAT(mixed[1].status(), StatusIs(absl::StatusCode::kInvalidArgument, "datums[0].tokens[0]"));
  EXPECT_TRUE(mixed[2].ok()) << mixed[2].status();
  EXPECT_EQ(joint[0]->pending_backward_calls(), 1);
  EXPECT_EQ(joint[1]->pending_backward_calls(), 0);
  EXPECT_EQ(mixed[0]->metrics.Get("co_scheduled_runs:max"), 2.0);
}

TEST_F(TrainerTest, ForwardReturnsTheLogprobsForwardBackwardUses) {
  TrainerOptions o = Options();
  o.lora.dropout = 0;
  auto trainer = NewTrainer(o);
  auto batch = RlBatch(0, 96);
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult f, trainer->Forward(batch));
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult fb, trainer->ForwardBackward(batch, Ppo()));
  ASSERT_EQ(f.logprobs.size(), batch.size());
  for (size_t d = 0; d < batch.size(); ++d) {
    ASSERT_EQ(f.logprobs[d].size(), batch[d].tokens.size());
    for (size_t i = 0; i < f.logprobs[d].size(); ++i) {
      EXPECT_FLOAT_EQ(f.logprobs[d][i], fb.logprobs[d][i]);
      EXPECT_LT(f.logprobs[d][i], 0.0f);
    }
  }
  // At step 0 with LoRA-B = 0 and old = the trainer's own log-probs, PPO's ratio is exactly 1
  // (miles' CI check: |ppo_kl| < 1e-8, pg_clipfrac < 1e-10).
  auto on_policy = batch;
  for (size_t d = 0; d < batch.size(); ++d) on_policy[d].old_logprobs = f.logprobs[d];
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult again, trainer->ForwardBackward(on_policy, Ppo()));
  EXPECT_LT(std::abs(again.metrics.Get("ppo_kl:mean")), 1e-8);
  EXPECT_LT(again.metrics.Get("pg_clipfrac:mean"), 1e-10);
}

TEST_F(TrainerTest, PeftExportImportRoundTripAndErrors) {
  auto trainer = NewTrainer();
  ASSERT_OK(trainer->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  ASSERT_OK(trainer->ExportAdapter(dir_ + "/peft"));
  ASSERT_OK_AND_ASSIGN(std::string cfg, ReadFileToString(dir_ + "/peft/adapter_config.json"));
  EXPECT_NE(cfg.find("\"peft_type\": \"LORA\""), std::string::npos);
  ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(dir_ + "/peft/adapter_model.safetensors"));
  EXPECT_TRUE(f.Find("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").ok());
  auto fresh = NewTrainer();
  ASSERT_OK(fresh->ImportAdapter(dir_ + "/peft"));
  EXPECT_EQ(fresh->AdapterSha256(), trainer->AdapterSha256());
  // The imported values survive the next optimizer step (the master copy took them): with
  // lr 0 the step changes nothing, where a stale master copy would revert the import.
  AdamWParams still = Adam();
  still.lr = 0;
  ASSERT_OK(fresh->TrainStep(RlBatch(1, 96), Ppo(), still));
  EXPECT_EQ(fresh->AdapterSha256(), trainer->AdapterSha256());
  TrainerOptions o = Options();
  o.lora.rank = 8;
  auto other = NewTrainer(o);
  const std::string before = other->AdapterSha256();
  EXPECT_THAT(other->ImportAdapter(dir_ + "/peft"),
              StatusIs(absl::StatusCode::kInvalidArgument, "r: 4 does not match"));
  EXPECT_EQ(other->AdapterSha256(), before);
}

TEST_F(TrainerTest, FullFinetuneRankZeroTrainsEveryWeight) {
  TrainerOptions o = Options();
  o.lora.rank = 0;
  auto trainer = NewTrainer(o);
  const size_t n = trainer->adapter().parameters().size();
  EXPECT_EQ(n, 2 + 12 * 2u);  // embed + final norm; per layer 2 norms, 7 linears, 3 biases
  std::vector<at::Tensor> before;
  for (const auto& p : trainer->adapter().parameters()) before.push_back(p.value.detach().clone());
  ASSERT_OK_AND_ASSIGN(OptimStepResult step, trainer->TrainStep(RlBatch(0, 96), Ppo(), Adam()));
  EXPECT_EQ(step.adapter_sha256, "");  // per-step digest skipped for full fine-tuning
  EXPECT_FALSE(step.metrics.Has("time_digest_s:sum"));
  for (size_t i = 0; i < n; ++i) {
    EXPECT_FALSE(at::equal(before[i], trainer->adapter().parameters()[i].value))
        << trainer->adapter().parameters()[i].name;
  }
  EXPECT_THAT(trainer->ExportAdapter(dir_ + "/x"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "rank-0"));
}

}  // namespace
}  // namespace lorastep

namespace lorastep {
namespace {

// The tiny model (or `preset`) saved under a scratch folder and loaded on CPU in fp32.
absl::StatusOr<std::shared_ptr<const BaseModel>> TinyBase(const std::string& name, ModelConfig* config,
                                                          const std::string& preset = "tiny") {
  const std::string dir = ::lorastep::testing::ScratchDir(name);
  *config = ModelConfigPreset(preset).value();
  LORASTEP_RETURN_IF_ERROR(SaveModel(dir + "/model", *config, RandomModelWeights(*config, 1)));
  return LoadBaseModel(dir + "/model", "cpu", "float32");
}

// Issue 8: one legal datum OOM-killed the worker. A micro-batch whose estimated activations
// exceed the worker's budget is refused before any work (RESOURCE_EXHAUSTED naming the
// datum), and the run is unchanged; batches within the budget run.
TEST(ActivationBudgetTest, OverBudgetMicroBatchIsRefusedBeforeAnyWork) {
  ModelConfig c;
  ASSERT_OK_AND_ASSIGN(auto base, TinyBase("act_budget", &c));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  const std::vector<Datum> small = RlBatch(0, c.vocab_size);
  const int64_t n = 500;  // under the tiny model's 512 positions
  const double small_need = EstimateActivationBytes(c, base->shard, small.size(), small[0].tokens.size(), true, 4,
                                                    o.logprob_chunk_tokens);
  const double huge_need = EstimateActivationBytes(c, base->shard, 1, n, true, 4, o.logprob_chunk_tokens);
  ASSERT_GT(huge_need, 2 * small_need);
  o.max_activation_bytes = static_cast<int64_t>((small_need + huge_need) / 2);
  ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(base, o));
  std::vector<Datum> huge = RlBatch(0, c.vocab_size);
  huge[1].tokens.assign(n, 1);
  huge[1].target_tokens.assign(n, 2);
  huge[1].logprobs.assign(n, -1.0f);
  huge[1].advantages.assign(n, 1.0f);
  ASSERT_GT(EstimateActivationBytes(c, base->shard, 1, n, true, 4, o.logprob_chunk_tokens),
            static_cast<double>(o.max_activation_bytes));
  EXPECT_THAT(trainer->TrainStep(huge, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "datums[1]: a micro-batch of 4 sequence(s), 518 tokens packed"));
  EXPECT_THAT(trainer->Forward(huge), StatusIs(absl::StatusCode::kResourceExhausted, "--max_activation_mb"));
  EXPECT_EQ(trainer->learner_version(), 0);
  EXPECT_EQ(trainer->pending_backward_calls(), 0);
  ASSERT_OK(trainer->TrainStep(small, Ppo(), Adam()).status());
  EXPECT_EQ(trainer->learner_version(), 1);
  // The estimate grows with the padded size and, for backward, with the layers kept.
  EXPECT_GT(EstimateActivationBytes(c, base->shard, 2, 512, true, 4, 1024),
            EstimateActivationBytes(c, base->shard, 1, 512, true, 4, 1024));
  EXPECT_GT(EstimateActivationBytes(c, base->shard, 1, 512, true, 4, 1024),
            EstimateActivationBytes(c, base->shard, 1, 512, false, 4, 1024));
  // Packed micro-batches count real tokens: one sequence is the padded estimate, a mix is less.
  EXPECT_DOUBLE_EQ(EstimatePackedActivationBytes(c, base->shard, {500}, true, 4, 1024),
                   EstimateActivationBytes(c, base->shard, 1, 500, true, 4, 1024));
  EXPECT_LT(EstimatePackedActivationBytes(c, base->shard, {500, 6, 6}, true, 4, 1024),
            EstimateActivationBytes(c, base->shard, 3, 500, true, 4, 1024));
  EXPECT_GT(AvailableHostMemoryBytes(), 0);
}

// Gated DeltaNet layers keep their chunked rule's intermediates for backward where the budget
// allows it without layer recomputation, and run the rule again in backward where only that
// fits: the same step either way, and the step's metrics say which micro-batches ran it again.
TEST(ActivationBudgetTest, LinearAttentionRuleIsRecomputedOnlyWhereKeepingItDoesNotFit) {
  ModelConfig c;
  ASSERT_OK_AND_ASSIGN(auto base, TinyBase("act_rule", &c, "tiny-qwen3.5"));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.activation_recompute = ActivationRecompute::kAuto;
  const std::vector<Datum> batch = RlBatch(0, c.vocab_size);
  std::vector<int64_t> lengths;
  for (const Datum& d : batch) lengths.push_back(static_cast<int64_t>(d.tokens.size()));
  auto estimate = [&](bool rule_kept) {
    return EstimatePackedActivationBytes(c, base->shard, lengths, true, 4, o.logprob_chunk_tokens,
                                         LayerRecompute::kNone, /*mlp_activation_kept=*/false, rule_kept);
  };
  ASSERT_GT(estimate(true), estimate(false));
  auto make = [&](int64_t max_bytes) {
    TrainerOptions t = o;
    t.max_activation_bytes = max_bytes;
    return Trainer::Create(base, t);
  };
  ASSERT_OK_AND_ASSIGN(auto unlimited, make(-1));
  ASSERT_OK_AND_ASSIGN(auto roomy, make(static_cast<int64_t>(estimate(true)) + 1));
  ASSERT_OK_AND_ASSIGN(auto tight, make(static_cast<int64_t>((estimate(true) + estimate(false)) / 2)));
  ASSERT_OK_AND_ASSIGN(OptimStepResult want, unlimited->TrainStep(batch, Ppo(), Adam()));
  EXPECT_EQ(want.metrics.Get("micro_batches_rule_recomputed:sum"), 0);
  for (auto* trainer : {roomy.get(), tight.get()}) {
    ASSERT_OK_AND_ASSIGN(OptimStepResult got, trainer->TrainStep(batch, Ppo(), Adam()));
    EXPECT_EQ(got.metrics.Get("micro_batches_recomputed:sum"), 0);  // no layer recomputation
    EXPECT_EQ(got.metrics.Get("micro_batches_rule_recomputed:sum"),
              trainer == tight.get() ? got.metrics.Get("micro_batches:sum") : 0.0);
    EXPECT_NEAR(got.metrics.Get("loss:sum"), want.metrics.Get("loss:sum"), 1e-6 * std::abs(want.metrics.Get("loss:sum")));
    const auto& pa = trainer->adapter().parameters();
    const auto& pb = unlimited->adapter().parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_LT(::lorastep::testing::RelErr(pa[i].value, pb[i].value), 1e-6) << pa[i].name;
    }
  }
  // A model without linear-attention layers reports no such figure.
  ModelConfig dense;
  ASSERT_OK_AND_ASSIGN(auto dense_base, TinyBase("act_rule_dense", &dense));
  ASSERT_OK_AND_ASSIGN(auto dense_trainer, Trainer::Create(dense_base, o));
  ASSERT_OK_AND_ASSIGN(OptimStepResult plain, dense_trainer->TrainStep(RlBatch(0, dense.vocab_size), Ppo(), Adam()));
  EXPECT_FALSE(plain.metrics.Has("micro_batches_rule_recomputed:sum"));
}

// Activation recomputation (issue 29): a micro-batch whose activations would exceed the
// budget but whose recomputed layers fit trains under "auto" (selective recomputation where
// it fits, else full; and always under "selective" or "full"), with the
// results of a run without recomputation and without a budget; "none" refuses it naming
// what recomputation would need, and changes nothing.
TEST(ActivationBudgetTest, RecomputationTrainsWhatWouldNotFitWithTheSameResults) {
  ModelConfig c;
  ASSERT_OK_AND_ASSIGN(auto base, TinyBase("act_recompute", &c));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.lora.dropout = 0.1;  // the replay must draw the same masks
  std::vector<Datum> batch = RlBatch(0, c.vocab_size);
  const int64_t n = 500;
  batch[1].tokens.assign(n, 1);
  batch[1].target_tokens.assign(n, 2);
  batch[1].logprobs.assign(n, -1.0f);
  batch[1].advantages.assign(n, 1.0f);
  std::vector<int64_t> lengths;
  for (const Datum& d : batch) lengths.push_back(static_cast<int64_t>(d.tokens.size()));
  const double plain = EstimatePackedActivationBytes(c, base->shard, lengths, true, 4, o.logprob_chunk_tokens);
  const double recomputed =
      EstimatePackedActivationBytes(c, base->shard, lengths, true, 4, o.logprob_chunk_tokens, LayerRecompute::kFull);
  const double selective = EstimatePackedActivationBytes(c, base->shard, lengths, true, 4, o.logprob_chunk_tokens,
                                                         LayerRecompute::kSelective);
  ASSERT_LT(recomputed, selective);
  ASSERT_LT(selective, plain);
  const int64_t budget = static_cast<int64_t>((selective + recomputed) / 2);  // only full fits
  const int64_t roomier = static_cast<int64_t>((plain + selective) / 2);      // selective fits too

  auto make = [&](ActivationRecompute mode, int64_t max_bytes) {
    TrainerOptions t = o;
    t.activation_recompute = mode;
    t.max_activation_bytes = max_bytes;
    return Trainer::Create(base, t);
  };
  ASSERT_OK_AND_ASSIGN(auto reference, make(ActivationRecompute::kNone, -1));
  ASSERT_OK_AND_ASSIGN(auto automatic, make(ActivationRecompute::kAuto, budget));
  ASSERT_OK_AND_ASSIGN(auto full, make(ActivationRecompute::kFull, -1));
  ASSERT_OK_AND_ASSIGN(auto selective_always, make(ActivationRecompute::kSelective, -1));
  ASSERT_OK_AND_ASSIGN(auto automatic_roomier, make(ActivationRecompute::kAuto, roomier));
  ASSERT_OK_AND_ASSIGN(auto none, make(ActivationRecompute::kNone, budget));
  ASSERT_OK_AND_ASSIGN(auto none_roomier, make(ActivationRecompute::kNone, roomier));
  ASSERT_OK_AND_ASSIGN(auto selective_tight, make(ActivationRecompute::kSelective, budget));

  EXPECT_THAT(none->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "with full activation recomputation it needs about"));
  EXPECT_THAT(none_roomier->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "with selective activation recomputation it needs about"));
  EXPECT_THAT(none_roomier->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "(activation_recompute \"auto\" or \"selective\")"));
  EXPECT_THAT(selective_tight->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "(activation_recompute \"auto\" or \"full\")"));
  // The refusal says how long a micro-batch may be at this budget, as sent and recomputed.
  auto longest = [&](LayerRecompute with_recompute) {
    int64_t n = 0;
    while (EstimatePackedActivationBytes(c, base->shard, {n + 1}, true, 4, o.logprob_chunk_tokens, with_recompute) <=
           static_cast<double>(budget)) {
      ++n;
    }
    return n;
  };
  ASSERT_GT(longest(LayerRecompute::kFull), longest(LayerRecompute::kNone));
  EXPECT_THAT(none->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       absl::StrCat("about ", longest(LayerRecompute::kNone), " tokens fit in one micro-batch (",
                                    longest(LayerRecompute::kFull), " with full activation recomputation)")));
  for (auto* refused : {none.get(), none_roomier.get(), selective_tight.get()}) {
    EXPECT_EQ(refused->learner_version(), 0);
    EXPECT_EQ(refused->pending_backward_calls(), 0);
  }

  ASSERT_OK_AND_ASSIGN(OptimStepResult want, reference->TrainStep(batch, Ppo(), Adam()));
  EXPECT_EQ(want.metrics.Get("micro_batches_recomputed:sum"), 0);
  for (auto* trainer : {automatic.get(), full.get(), selective_always.get(), automatic_roomier.get()}) {
    ASSERT_OK_AND_ASSIGN(OptimStepResult got, trainer->TrainStep(batch, Ppo(), Adam()));
    EXPECT_EQ(got.metrics.Get("micro_batches_recomputed:sum"), got.metrics.Get("micro_batches:sum"));
    const bool selects = trainer == selective_always.get() || trainer == automatic_roomier.get();
    EXPECT_EQ(got.metrics.Get("micro_batches_recomputed_selective:sum"),
              selects ? got.metrics.Get("micro_batches:sum") : 0.0);
    EXPECT_NEAR(got.metrics.Get("loss:sum"), want.metrics.Get("loss:sum"), 1e-6 * std::abs(want.metrics.Get("loss:sum")));
    EXPECT_NEAR(got.metrics.Get("grad_norm:sum"), want.metrics.Get("grad_norm:sum"),
                1e-6 * want.metrics.Get("grad_norm:sum"));
    const auto& pa = trainer->adapter().parameters();
    const auto& pb = reference->adapter().parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      EXPECT_LT(::lorastep::testing::RelErr(pa[i].value, pb[i].value), 1e-6) << pa[i].name;
    }
  }
  // Forward-only calls keep no activations: nothing to recompute, and the budget still holds.
  ASSERT_OK_AND_ASSIGN(ForwardBackwardResult f, automatic->Forward(batch));
  EXPECT_FALSE(f.metrics.Has("micro_batches_recomputed:sum"));
  // A LoRA run without dropout keeps no SwiGLU activation (down_proj rebuilds it): its
  // estimate is the smaller one; with dropout it is kept and counted.
  const double lean = EstimatePackedActivationBytes(c, base->shard, lengths, true, 4, o.logprob_chunk_tokens,
                                                    LayerRecompute::kNone, /*mlp_activation_kept=*/false);
  ASSERT_LT(lean, plain);
  TrainerOptions no_dropout = o;
  no_dropout.lora.dropout = 0;
  no_dropout.activation_recompute = ActivationRecompute::kNone;
  no_dropout.max_activation_bytes = static_cast<int64_t>((lean + plain) / 2);
  ASSERT_OK_AND_ASSIGN(auto lean_trainer, Trainer::Create(base, no_dropout));
  ASSERT_OK(lean_trainer->TrainStep(batch, Ppo(), Adam()).status());
  TrainerOptions with_dropout = no_dropout;
  with_dropout.lora.dropout = 0.1;
  ASSERT_OK_AND_ASSIGN(auto kept_trainer, Trainer::Create(base, with_dropout));
  EXPECT_THAT(kept_trainer->TrainStep(batch, Ppo(), Adam()), StatusIs(absl::StatusCode::kResourceExhausted, ""));
  EXPECT_THAT(ParseActivationRecompute("sometimes", "--activation_recompute"),
              StatusIs(absl::StatusCode::kInvalidArgument, "--activation_recompute: \"sometimes\""));
  EXPECT_EQ(ParseActivationRecompute("full", "f").value(), ActivationRecompute::kFull);
  EXPECT_EQ(ParseActivationRecompute("selective", "f").value(), ActivationRecompute::kSelective);
}

// The default CPU budget counts the limits of the process's own cgroup and its ancestors
// (issue 26, defect 8: only the root's memory.max was read, which a service's or a nested
// container's cgroup never sets). A cgroup tree written under a scratch folder stands in for
// /sys/fs/cgroup.
TEST(ActivationBudgetTest, CgroupRoomIsTheTightestLimitOnThePath) {
  const std::string root = ::lorastep::testing::ScratchDir("cgroup_tree");
  auto write = [&](const std::string& rel, const std::string& text) {
    ASSERT_OK(MakeDirectories(ParentPath(root + rel)));
    ASSERT_OK(WriteStringToFile(root + rel, text));
  };
  write("/memory.max", "max\n");  // the root: no limit
  write("/system.slice/memory.max", "8000000000\n");
  write("/system.slice/memory.current", "1000000000\n");
  write("/system.slice/lorastep.service/memory.max", "3000000000\n");
  write("/system.slice/lorastep.service/memory.current", "2500000000\n");
  EXPECT_EQ(CgroupMemoryRoom("0::/system.slice/lorastep.service\n", root), 500000000);
  EXPECT_EQ(CgroupMemoryRoom("0::/system.slice\n", root), 7000000000);
  EXPECT_EQ(CgroupMemoryRoom("0::/\n", root), -1);
  // cgroup v1: the memory controller's hierarchy; its "no limit" is a huge number.
  write("/memory/docker/abc/memory.limit_in_bytes", "2000000000\n");
  write("/memory/docker/abc/memory.usage_in_bytes", "500000000\n");
  write("/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryRoom("12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n", root), 1500000000);
  EXPECT_EQ(CgroupMemoryRoom("garbage\n", root), -1);
}

// With the default budget (0), a micro-batch the device cannot hold is refused before any
// work, on CUDA (the device's available memory) as on CPU (the host's): 31 datums of
// 131,072 tokens (the per-datum limit) packed into one micro-batch on a wide one-layer
// model need ~200 GB of activations in bf16.
TEST(ActivationBudgetTest, DefaultBudgetRefusesWhatTheDeviceCannotHold) {
  const std::string dir = ::lorastep::testing::ScratchDir("default_budget");
  ModelConfig c = ModelConfigPreset("tiny").value();
  c.hidden_size = 1024;
  c.intermediate_size = 4096;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 8;
  c.max_position_embeddings = 1 << 17;
  ASSERT_OK(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)));
  ASSERT_OK_AND_ASSIGN(auto base, LoadBaseModel(dir + "/model", ::lorastep::testing::TestDevice().str(),
                                                ::lorastep::testing::TestDtypeName()));
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.max_tokens_per_microbatch = 1 << 23;
  ASSERT_EQ(o.max_activation_bytes, 0);
  ASSERT_OK_AND_ASSIGN(auto trainer, Trainer::Create(base, o));
  const int64_t n = 1 << 17;
  Datum d;
  d.tokens.assign(n, 1);
  d.target_tokens.assign(n, 2);
  d.logprobs.assign(n, -1.0f);
  d.advantages.assign(n, 1.0f);
  const std::vector<Datum> batch(31, d);
  EXPECT_GT(EstimatePackedActivationBytes(c, base->shard, std::vector<int64_t>(31, n), true, 2, o.logprob_chunk_tokens),
            180e9);
  EXPECT_THAT(trainer->TrainStep(batch, Ppo(), Adam()),
              StatusIs(absl::StatusCode::kResourceExhausted, "--max_activation_mb"));
  EXPECT_THAT(trainer->Forward(batch), StatusIs(absl::StatusCode::kResourceExhausted, "--max_activation_mb"));
  EXPECT_EQ(trainer->learner_version(), 0);
}

// Device tensors are hashed where they are (the GPU kernel in the CUDA build, else host
// threads after one pinned copy per dtype), in chunks: the digest equals that of the same
// bytes already on the host, covers every byte (a change in the last chunk changes it), and
// the tensors' order counts. The sizes put chunk ends and tensor starts off every alignment
// (odd bf16 lengths, remainders of 54 and 56 bytes either side of where SHA-256's length
// field still fits in the last block, an empty tensor).
TEST(DigestTest, DeviceTensorsHashLikeTheirHostCopies) {
  const at::Device dev = ::lorastep::testing::TestDevice();
  std::vector<at::Tensor> host{at::randn({3 << 20}, at::kFloat), at::randn({7, 5}, at::kFloat),
                               at::randn({11}, at::kFloat).to(at::kBFloat16),
                               at::randn({(16 << 9) + 28}, at::kFloat).to(at::kBFloat16),
                               at::randn({0}, at::kFloat).to(at::kBFloat16),
                               at::randn({(16 << 9) + 27}, at::kFloat).to(at::kBFloat16),
                               at::randn({1 << 18}, at::kFloat)};
  std::vector<at::Tensor> device;
  for (const at::Tensor& t : host) device.push_back(t.to(dev));
  const std::string want = TensorsSha256(host);
  EXPECT_EQ(TensorsSha256(device), want);
  device.back()[(1 << 18) - 1].add_(1.0);
  EXPECT_NE(TensorsSha256(device), want);
  // Groups hashed together give each group's own digest (several runs after a shared step).
  const std::vector<at::Tensor> first(device.begin(), device.begin() + 3), rest(device.begin() + 3, device.end());
  EXPECT_EQ(TensorGroupsSha256({first, {}, rest}),
            (std::vector<std::string>{TensorsSha256(first), TensorsSha256({}), TensorsSha256(rest)}));
  std::swap(host[1], host[2]);
  EXPECT_NE(TensorsSha256(host), want);
  // Views into one buffer (an adapter's packed values), overlapping and one strided, hash
  // like contiguous host copies of each.
  const at::Tensor buffer = at::randn({(16 << 10) + 77}, at::kFloat).to(dev);
  const std::vector<at::Tensor> views{buffer.narrow(0, 5, 9000).view({90, 100}),
                                      buffer.narrow(0, 8000, 3000).view({30, 100}).t(), buffer.narrow(0, 0, 1)};
  std::vector<at::Tensor> copies;
  for (const at::Tensor& v : views) copies.push_back(v.contiguous().to(at::kCPU));
  EXPECT_EQ(TensorsSha256(views), TensorsSha256(copies));
  EXPECT_EQ(TensorGroupsSha256({views, {views[1]}}),
            (std::vector<std::string>{TensorsSha256(copies), TensorsSha256({copies[1]})}));
  // The definition, pinned against Python's hashlib: SHA-256 over each tensor's dtype name,
  // its sizes as little-endian int64 and the SHA-256 of each 16 KiB chunk of its bytes.
  const at::Tensor counting = at::arange(5, at::kFloat).to(dev), halves = at::full({2, 3}, 0.5f).to(dev);
  EXPECT_EQ(TensorsSha256({counting}), "7c4f1e6f22ec7eae2e4de173a21118f580f06146ef60ee97790f582f6832e5d8");
  EXPECT_EQ(TensorsSha256({counting, halves}), "0624c9dea03389b2c302306164de295488db31c308fe24c0bcd997e5a444cddc");
}

// Datums of equal length stay padded rows (SDPA's fused kernel serves them) unless a layer
// has a sliding window or sinks and the varlen kernel serves the model: then they are packed
// for it. Unequal lengths pack either way, and without pack_sequences nothing packs.
TEST(MicroBatchLayoutTest, EqualLengthsArePackedOnlyForTheVarlenKernelsWindowsAndSinks) {
  std::vector<Datum> datums(3);
  for (Datum& d : datums) d.tokens = d.target_tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<Datum> unequal = datums;
  unequal[1].tokens = unequal[1].target_tokens = {1, 2, 3};
  const std::vector<size_t> all = {0, 1, 2};
  for (const char* preset : {"tiny", "tiny-qwen2-swa", "tiny-gpt-oss"}) {
    for (bool varlen : {false, true}) {
      SCOPED_TRACE(::testing::Message() << preset << (varlen ? " with" : " without") << " the varlen kernel");
      const ModelConfig config = ModelConfigPreset(preset).value();
      MicroBatchOptions options;
      options.varlen_attention = varlen;
      MicroBatchCounts counts;
      EXPECT_EQ(BuildMicroBatch(datums, all, config, options, at::kCPU, &counts).is_packed,
                varlen && std::string(preset) != "tiny");
      EXPECT_TRUE(BuildMicroBatch(unequal, all, config, options, at::kCPU, &counts).is_packed);
      options.pack_sequences = false;
      EXPECT_FALSE(BuildMicroBatch(datums, all, config, options, at::kCPU, &counts).is_packed);
    }
  }
}

}  // namespace
}  // namespace lorastep
