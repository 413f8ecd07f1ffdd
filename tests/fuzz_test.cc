// Seeded mutation fuzzing (no libFuzzer in Debian's gcc build): valid inputs are mutated
// at random (bit flips, extreme bytes, truncation, splices of header text) for a fixed time
// budget per target, and every parser must return a Status, never crash, and a failed load
// or import must leave the run unchanged. Targets: safetensors files, checkpoint folders
// (Trainer::LoadState), PEFT adapter folders (Trainer::ImportAdapter), and request
// validation (ValidateBatch; a batch it accepts must then train), and packed datums in
// serialized requests (RequestDatums).
//   LORASTEP_FUZZ_SECONDS (default 4 per target), LORASTEP_FUZZ_SEED (default 1).
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/training/batch.h"
#include "lib/training/trainer.h"
#include "rpc/proto_convert.h"
#include "tests/test_util.h"
#include "tools/model_presets.h"

namespace lorastep {
namespace {

using ::lorastep::testing::ScratchDir;

double BudgetSeconds() {
  const char* s = std::getenv("LORASTEP_FUZZ_SECONDS");
  return s != nullptr ? std::atof(s) : 4.0;
}
uint64_t Seed() {
  const char* s = std::getenv("LORASTEP_FUZZ_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 10) : 1;
}

// One random mutation of `bytes`, biased towards the first 512 bytes (the header).
std::string Mutate(std::string bytes, std::mt19937_64& rng) {
  if (bytes.empty()) return std::string(1, static_cast<char>(rng()));
  auto pos = [&]() -> size_t {
    const size_t span = (rng() % 4 == 0) ? bytes.size() : std::min<size_t>(bytes.size(), 512);
    return rng() % span;
  };
  const int kinds = 6;
  for (int n = 1 + static_cast<int>(rng() % 3); n > 0; --n) {
    switch (rng() % kinds) {
      case 0: bytes[pos()] ^= static_cast<char>(1u << (rng() % 8)); break;
      case 1: {
        static const char extremes[] = {'\0', '\x7f', '\x80', '\xff', '"', '{', '}', '[', ']', ',', ':', '-', '9'};
        bytes[pos()] = extremes[rng() % sizeof(extremes)];
        break;
      }
      case 2: bytes.resize(pos()); break;  // truncation
      case 3: {  // a header length prefix rewritten (little-endian u64 at 0)
        const uint64_t v = (rng() % 2) ? rng() : (rng() % (bytes.size() * 2 + 16));
        for (int i = 0; i < 8 && i < static_cast<int>(bytes.size()); ++i) bytes[i] = static_cast<char>(v >> (8 * i));
        break;
      }
      case 4: {  // a run of the text duplicated (numbers and names in JSON get longer)
        const size_t a = pos(), len = std::min<size_t>(bytes.size() - a, 1 + rng() % 16);
        bytes.insert(a, bytes.substr(a, len));
        break;
      }
      case 5: {  // a digit run replaced by a huge or negative number
        static const char* numbers[] = {"99999999999999999999", "-1", "1e308", "NaN", "0", "18446744073709551615"};
        const size_t a = pos();
        bytes.replace(a, std::min<size_t>(bytes.size() - a, 1 + rng() % 4), numbers[rng() % 6]);
        break;
      }
    }
    if (bytes.empty()) break;
  }
  return bytes;
}

struct Harness {
  std::string dir;
  std::shared_ptr<const BaseModel> base;
  std::unique_ptr<Trainer> trainer;
  ModelConfig config;
};

Harness MakeHarness(const std::string& name) {
  Harness h;
  h.dir = ScratchDir(name);
  h.config = ModelConfigPreset("tiny").value();
  EXPECT_TRUE(SaveModel(h.dir + "/model", h.config, RandomModelWeights(h.config, 1)).ok());
  h.base = LoadBaseModel(h.dir + "/model", "cpu", "float32").value();
  TrainerOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8;
  h.trainer = Trainer::Create(h.base, o).value();
  return h;
}

std::vector<Datum> SmallBatch(int64_t vocab) {
  std::vector<Datum> out(3);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 6 + i; ++j) {
      out[i].tokens.push_back((i * 7 + j * 3) % vocab);
      out[i].target_tokens.push_back((i * 5 + j * 11) % vocab);
      out[i].logprobs.push_back(-4.0f);
      out[i].advantages.push_back(j < 2 ? 0.0f : 1.0f);
    }
  }
  return out;
}

LossConfig Ppo() {
  LossConfig l;
  l.kind = LossKind::kPpo;
  return l;
}

// Mutates one file of a folder the trainer wrote, `rounds` times within the budget, and
// runs `load` on the mutated copy; a failed load must change nothing.
int FuzzFolder(Harness& h, const std::string& folder, const std::vector<std::string>& files,
               const std::function<absl::Status(const std::string&)>& load, std::mt19937_64& rng) {
  std::vector<std::string> originals;
  for (const auto& f : files) originals.push_back(ReadFileToString(folder + "/" + f).value());
  const std::string before = h.trainer->AdapterSha256();
  const int64_t version = h.trainer->learner_version();
  int tried = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(BudgetSeconds());
  // The budget, and at least 25 loads: each one writes (and fsyncs) its files, and on a
  // 2-core CI machine whose disk other tests keep busy 4 s once gave only 13.
  while (std::chrono::steady_clock::now() < end || tried < 25) {
    const size_t which = rng() % files.size();
    for (size_t i = 0; i < files.size(); ++i) {
      EXPECT_TRUE(WriteStringToFile(folder + "/" + files[i], i == which ? Mutate(originals[i], rng) : originals[i]).ok());
    }
    const absl::Status s = load(folder);
    ++tried;
    if (!s.ok()) {
      EXPECT_EQ(h.trainer->AdapterSha256(), before) << s;
      EXPECT_EQ(h.trainer->learner_version(), version) << s;
      EXPECT_NE(s.code(), absl::StatusCode::kUnknown) << s;
    } else {  // a mutation that still parses (e.g. inside tensor data): restore the state
      EXPECT_TRUE(h.trainer->LoadState(h.dir + "/good").ok());
    }
  }
  return tried;
}

TEST(FuzzTest, SafetensorsParserNeverCrashes) {
  const std::string dir = ScratchDir("fuzz_st");
  ModelConfig c = ModelConfigPreset("tiny").value();
  ASSERT_OK(SaveModel(dir + "/model", c, RandomModelWeights(c, 1)));
  const std::string good = ReadFileToString(dir + "/model/model.safetensors").value();
  std::mt19937_64 rng(Seed());
  int tried = 0, accepted = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(BudgetSeconds());
  while (std::chrono::steady_clock::now() < end) {
    ASSERT_OK(WriteStringToFile(dir + "/m.safetensors", Mutate(good, rng)));
    auto f = SafetensorsFile::Open(dir + "/m.safetensors");
    ++tried;
    if (!f.ok()) continue;
    ++accepted;
    for (const SafetensorsEntry& e : f->entries()) {  // every accepted entry must convert
      auto t = TensorFromEntry(e);
      if (t.ok()) {
        EXPECT_EQ(t->numel(), e.numel());
      }
    }
  }
  std::cout << "bad_inputs_tried safetensors " << tried << " (accepted " << accepted << ")\n";
  EXPECT_GT(tried, 100);
}

TEST(FuzzTest, CorruptCheckpointsAndAdaptersChangeNothing) {
  Harness h = MakeHarness("fuzz_ck");
  ASSERT_OK(h.trainer->TrainStep(SmallBatch(h.config.vocab_size), Ppo(), AdamWParams{}).status());
  ASSERT_OK(h.trainer->SaveState(h.dir + "/good"));
  ASSERT_OK(h.trainer->SaveState(h.dir + "/ck"));
  ASSERT_OK(h.trainer->ExportAdapter(h.dir + "/peft"));
  std::mt19937_64 rng(Seed() + 1);
  const int checkpoints = FuzzFolder(h, h.dir + "/ck", {"trainable.safetensors", "optimizer.safetensors", "trainer_state.json"},
                                     [&](const std::string& f) { return h.trainer->LoadState(f); }, rng);
  const int adapters = FuzzFolder(h, h.dir + "/peft", {"adapter_config.json", "adapter_model.safetensors"},
                                  [&](const std::string& f) { return h.trainer->ImportAdapter(f); }, rng);
  std::cout << "bad_inputs_tried checkpoints " << checkpoints << " adapters " << adapters << "\n";
  EXPECT_GT(checkpoints, 20);
  EXPECT_GT(adapters, 20);
  // Still a healthy run.
  ASSERT_OK(h.trainer->TrainStep(SmallBatch(h.config.vocab_size), Ppo(), AdamWParams{}).status());
}

TEST(FuzzTest, RequestValidationAcceptsOnlyWhatTrains) {
  Harness h = MakeHarness("fuzz_req");
  std::mt19937_64 rng(Seed() + 2);
  const int64_t vocab = h.config.vocab_size;
  int tried = 0, accepted = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(BudgetSeconds());
  static const float kValues[] = {0.0f, 1.0f, -1.0f, -5.0f, 3e38f, -3e38f, 1e-30f, 0.5f,
                                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()};
  while (std::chrono::steady_clock::now() < end) {
    std::vector<Datum> batch(1 + rng() % 3);
    for (Datum& d : batch) {
      const int n = static_cast<int>(rng() % 12);
      auto len = [&]() { return rng() % 8 == 0 ? n + static_cast<int>(rng() % 3) - 1 : n; };
      for (int i = len(); i > 0; --i) d.tokens.push_back(rng() % 16 == 0 ? static_cast<int64_t>(rng()) : rng() % vocab);
      for (int i = len(); i > 0; --i) d.target_tokens.push_back(rng() % 16 == 0 ? -1 : rng() % vocab);
      for (int i = len(); i > 0; --i) d.advantages.push_back(kValues[rng() % 10]);
      if (rng() % 2) for (int i = len(); i > 0; --i) d.logprobs.push_back(-std::abs(kValues[rng() % 10]));
    }
    LossConfig loss = Ppo();
    if (rng() % 3 == 0) loss.normalization = LossNormalization::kSequence;
    const absl::Status valid = ValidateBatch(batch, loss, vocab, {});
    ++tried;
    if (!valid.ok()) {
      EXPECT_EQ(valid.code(), absl::StatusCode::kInvalidArgument) << valid;
      continue;
    }
    ++accepted;
    auto r = h.trainer->ForwardBackward(batch, loss);  // accepted input must run
    EXPECT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kFailedPrecondition) << r.status();
  }
  std::cout << "bad_inputs_tried requests " << tried << " (accepted " << accepted << ")\n";
  EXPECT_GT(tried, 100);
}

// Packed datums as the coordinator and the workers parse them: mutated serialized requests
// either fail to parse, or RequestDatums refuses them with INVALID_ARGUMENT, or every datum
// it returns has arrays of its tokens' length (or none), which validation then judges.
TEST(FuzzTest, PackedDatumsNeverCrashOrMisalign) {
  std::mt19937_64 rng(Seed() + 3);
  google::protobuf::SetLogHandler(nullptr);  // mutated strings are invalid UTF-8: no log per parse
  std::vector<Datum> batch(3);
  for (size_t d = 0; d < batch.size(); ++d) {
    for (int i = 0; i < 5 + static_cast<int>(d); ++i) {
      batch[d].tokens.push_back(i);
      batch[d].target_tokens.push_back(i + 1);
      batch[d].logprobs.push_back(-1.0f);
      batch[d].advantages.push_back(1.0f);
    }
  }
  v1::TrainStepRequest good;
  SetRequestDatums(batch, {0, 1, 2}, good.mutable_datums(), good.mutable_packed_datums());
  ASSERT_EQ(good.datums_size(), 0);
  const std::string bytes = good.SerializeAsString();
  int tried = 0, parsed = 0, accepted = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(BudgetSeconds());
  while (std::chrono::steady_clock::now() < end) {
    ++tried;
    v1::TrainStepRequest req;
    if (!req.ParseFromString(Mutate(bytes, rng))) continue;
    ++parsed;
    absl::StatusOr<std::vector<Datum>> datums = RequestDatums(req.datums(), req.packed_datums());
    if (!datums.ok()) {
      EXPECT_EQ(datums.status().code(), absl::StatusCode::kInvalidArgument) << datums.status();
      continue;
    }
    // (A mutation may also turn the bytes into `datums`, whose lengths ValidateBatch checks.)
    const bool packed = req.packed_datums().ByteSizeLong() > 0;
    for (size_t i = 0; packed && i < datums->size(); ++i) {
      const Datum& d = (*datums)[i];
      EXPECT_EQ(d.target_tokens.size(), d.tokens.size());
      for (const auto* f : {&d.weights, &d.logprobs, &d.advantages, &d.ref_logprobs, &d.old_logprobs}) {
        EXPECT_TRUE(f->empty() || f->size() == d.tokens.size());
      }
    }
    const absl::Status valid = ValidateBatch(*datums, Ppo(), 96, {});
    EXPECT_TRUE(valid.ok() || valid.code() == absl::StatusCode::kInvalidArgument) << valid;
    accepted += valid.ok() ? 1 : 0;
  }
  std::cout << "bad_inputs_tried packed " << tried << " (parsed " << parsed << ", valid " << accepted << ")\n";
  EXPECT_GT(parsed, 100);
}

// Packing into a message that held another batch (as RunSession does every step, to keep the
// arrays' buffers) leaves exactly the new batch; a batch the packed form cannot say leaves it
// empty.
// PackedDatumsField: appended to an enclosing message's bytes, its head and pieces parse as
// that message's packed_datums, with either target form and absent optional arrays; every
// field of PackedDatums but `lengths` is a byte array it sends from where it is.
TEST(PackDatumsTest, APackedBatchWrittenFromItsOwnArraysParsesAsTheField) {
  for (const char* targets : {"own", "next-token"}) {
    std::vector<v1::Datum> datums(3);
    for (int i = 0; i < 3; ++i) {
      for (int t = 0; t < 5 + 200 * i; ++t) {
        datums[i].add_tokens(t % 96);
        datums[i].add_target_tokens(std::string(targets) == "own" ? (t * 7) % 96 : (t + 1) % 96);
        datums[i].add_logprobs(-0.25f * static_cast<float>(t % 5));
      }
      if (std::string(targets) == "next-token") datums[i].set_target_tokens(datums[i].tokens_size() - 1, 3);
    }
    v1::WorkerTrainStepRequest req;
    req.set_run_id("run");
    ASSERT_TRUE(PackDatums(datums, req.mutable_packed_datums()));
    v1::WorkerTrainStepRequest bare = req;
    bare.clear_packed_datums();
    std::string bytes = bare.SerializeAsString();
    {
      PackedDatumsField field(v1::WorkerTrainStepRequest::kPackedDatumsFieldNumber, req.packed_datums());
      bytes += field.head();
      for (absl::string_view piece : field.pieces()) bytes.append(piece.data(), piece.size());
    }
    v1::WorkerTrainStepRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes)) << targets;
    EXPECT_EQ(parsed.SerializeAsString(), req.SerializeAsString()) << targets;
    EXPECT_EQ(parsed.packed_datums().last_target_tokens().empty(), std::string(targets) == "own");
  }
  const google::protobuf::Descriptor* d = v1::PackedDatums::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    EXPECT_TRUE(f->name() == "lengths" ||
                (f->type() == google::protobuf::FieldDescriptor::TYPE_BYTES && !f->is_repeated()))
        << f->name() << ": PackedDatumsField sends only lengths and byte arrays";
  }
}

TEST(PackDatumsTest, AReusedMessageHoldsOnlyTheLatestBatch) {
  auto datum = [](int n, int64_t first, bool with_logprobs) {
    v1::Datum d;
    for (int i = 0; i < n; ++i) {
      d.add_tokens(first + i);
      d.add_target_tokens(first + i + 1);
      d.add_advantages(0.5f * i);
      if (with_logprobs) d.add_logprobs(-0.25f * i);
    }
    return d;
  };
  v1::PackedDatums packed;
  ASSERT_TRUE(PackDatums({datum(40, 3, true), datum(50, 7, true), datum(60, 9, true)}, &packed));
  const std::vector<v1::Datum> second = {datum(5, 100, false), datum(6, 200, false)};
  ASSERT_TRUE(PackDatums(second, &packed));
  google::protobuf::RepeatedPtrField<v1::Datum> none;
  absl::StatusOr<std::vector<Datum>> got = RequestDatums(none, packed);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  for (size_t i = 0; i < second.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, std::vector<int64_t>(second[i].tokens().begin(), second[i].tokens().end()));
    EXPECT_EQ((*got)[i].target_tokens,
              std::vector<int64_t>(second[i].target_tokens().begin(), second[i].target_tokens().end()));
    EXPECT_TRUE((*got)[i].logprobs.empty());
    EXPECT_EQ((*got)[i].advantages.size(), static_cast<size_t>(second[i].tokens_size()));
  }
  v1::Datum too_wide = datum(3, 1, false);
  too_wide.set_tokens(1, int64_t{1} << 40);  // outside int32: only the repeated form can say it
  EXPECT_FALSE(PackDatums({datum(4, 1, false), too_wide}, &packed));
  EXPECT_EQ(packed.ByteSizeLong(), 0u);
  v1::Datum wide_last_target = datum(3, 1, false);
  wide_last_target.set_target_tokens(2, int64_t{1} << 40);
  EXPECT_FALSE(PackDatums({datum(4, 1, false), wide_last_target}, &packed));
  EXPECT_EQ(packed.ByteSizeLong(), 0u);
}

// Next-token targets are recognized while the tokens are packed: a batch whose targets stop
// being the tokens shifted by one late (the last datum, past its first 1024 positions) packs
// its targets as an array of their own, and both forms unpack to the datums sent.
TEST(PackDatumsTest, TargetsThatStopBeingShiftedLatePackAsTheirOwnArray) {
  auto datum = [](int n, int64_t first) {
    v1::Datum d;
    for (int i = 0; i < n; ++i) {
      d.add_tokens(first + i);
      d.add_target_tokens(first + i + 1);
      d.add_advantages(0.5f * i);
    }
    return d;
  };
  for (const bool shifted : {true, false}) {
    std::vector<v1::Datum> batch = {datum(40, 3), datum(1500, 7), datum(2100, 9)};
    if (!shifted) batch[2].set_target_tokens(1700, 5);
    v1::PackedDatums packed;
    ASSERT_TRUE(PackDatums(batch, &packed));
    EXPECT_EQ(packed.last_target_tokens().empty(), !shifted);
    EXPECT_EQ(packed.target_tokens().empty(), shifted);
    google::protobuf::RepeatedPtrField<v1::Datum> none;
    absl::StatusOr<std::vector<Datum>> got = RequestDatums(none, packed);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      EXPECT_EQ((*got)[i].tokens, std::vector<int64_t>(batch[i].tokens().begin(), batch[i].tokens().end()));
      EXPECT_EQ((*got)[i].target_tokens,
                std::vector<int64_t>(batch[i].target_tokens().begin(), batch[i].target_tokens().end()))
          << "shifted " << shifted << ", datum " << i;
    }
  }
}

}  // namespace
}  // namespace lorastep
