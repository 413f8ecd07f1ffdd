// Trainer.Sample through a real coordinator and its worker process (tiny model, CPU, fp32):
// every sampled token's log-prob equals Forward's on the returned sequence; the same seed
// gives the same tokens; a Sample after a TrainStep samples that step's weights (its learner
// version in the answer, and log-probs that Forward of the new weights gives); the base
// model is sampled on request; bad requests are refused naming the field; another key's run
// is NOT_FOUND.
#include <string>
#include <vector>

#include "clients/cpp/trainer_client.h"
#include "gtest/gtest.h"
#include "server/child_server.h"
#include "tests/service_test_util.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using namespace service_testing;  // NOLINT: the service tests' shared helpers

v1::SampleRequest SampleOf(const std::string& run_id, std::vector<std::vector<int64_t>> prompts, int64_t max_tokens,
                           double temperature, uint64_t seed, int64_t num_samples = 1) {
  v1::SampleRequest req;
  req.set_run_id(run_id);
  for (const auto& p : prompts) req.add_prompts()->mutable_tokens()->Add(p.begin(), p.end());
  req.set_num_samples(num_samples);
  req.mutable_params()->set_max_tokens(max_tokens);
  req.mutable_params()->set_temperature(temperature);
  req.mutable_params()->set_seed(seed);
  return req;
}

// Forward's log-probs of `sequence`'s tokens after the first `prompt` of them.
std::vector<float> ForwardLogprobs(RunSession* run, const std::vector<int64_t>& prompt, const v1::SampledSequence& s) {
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), s.tokens().begin(), s.tokens().end());
  v1::Datum d;
  d.mutable_tokens()->Add(all.begin(), all.end() - 1);
  d.mutable_target_tokens()->Add(all.begin() + 1, all.end());
  absl::StatusOr<v1::ForwardBackwardResponse> fwd = run->Forward({d});
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  if (!fwd.ok()) return {};
  const auto& values = fwd->logprobs(0).values();
  return std::vector<float>(values.begin() + static_cast<int64_t>(prompt.size()) - 1, values.end());
}

TEST(SampleServiceTest, SampledLogProbsAreForwardsAndFollowTheRunsSteps) {
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("sample_service"));
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server.address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 3));
  const std::vector<std::vector<int64_t>> prompts = {{5, 17, 3, 42, 9}, {1, 2, 3}};
  auto check = [&](const v1::SampleResponse& got, int64_t version) {
    EXPECT_EQ(got.learner_version(), version);
    ASSERT_EQ(got.prompts_size(), 2);
    for (int p = 0; p < 2; ++p) {
      ASSERT_EQ(got.prompts(p).sequences_size(), 3);
      for (const v1::SampledSequence& s : got.prompts(p).sequences()) {
        ASSERT_EQ(s.tokens_size(), 8);
        EXPECT_EQ(s.stop_reason(), "length");
        const std::vector<float> want = ForwardLogprobs(&run, prompts[p], s);
        ASSERT_EQ(want.size(), 8u);
        for (int i = 0; i < 8; ++i) EXPECT_NEAR(s.logprobs(i), want[i], 1e-5) << "prompt " << p << " token " << i;
      }
    }
  };
  const v1::SampleRequest req = SampleOf(run.run_id(), prompts, 8, 1.0, 42, 3);
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse first, client->Sample(req));
  check(first, 0);
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse again, client->Sample(req));
  for (int p = 0; p < 2; ++p) {
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(std::vector<int64_t>(first.prompts(p).sequences(s).tokens().begin(), first.prompts(p).sequences(s).tokens().end()),
                std::vector<int64_t>(again.prompts(p).sequences(s).tokens().begin(), again.prompts(p).sequences(s).tokens().end()));
    }
  }
  // After two steps the run samples its new weights.
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  ASSERT_OK(run.TrainStep(Batch(1), Ppo(), Adam()).status());
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse stepped, client->Sample(req));
  check(stepped, 2);
  // The base model: its log-probs differ from the trained adapter's.
  v1::SampleRequest base = SampleOf(run.run_id(), {prompts[0]}, 4, 0.0, 1);
  base.set_base_model(true);
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse from_base, client->Sample(base));
  ASSERT_EQ(from_base.prompts(0).sequences(0).tokens_size(), 4);
  EXPECT_EQ(from_base.prompts(0).sequences(0).sampling_logprobs(0), 0.0f);  // greedy
}

// A saved adapter samples as the run did when it was saved: an exported PEFT folder and a
// SaveState checkpoint give the tokens the live run gave at that version (same request),
// after the run has moved on; the checkpoint reports its version, the PEFT folder 0.
// Qwen3.5 through the worker: its cache keeps the attention layer's keys and values and each
// sequence's Gated DeltaNet state beside them (budgeted); the log-probs are Forward's.
TEST(SampleServiceTest, HybridLinearAttentionModelSamplesTheTrainersLogProbs) {
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("sample_service_qwen3_5", {"--kv_cache_mb", "1"},
                                                                "tiny-qwen3.5"));
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server.address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 3));
  const std::vector<int64_t> prompt = {5, 17, 3, 42, 9, 11, 2};
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse got, client->Sample(SampleOf(run.run_id(), {prompt}, 6, 1.0, 7, 4)));
  ASSERT_EQ(got.prompts(0).sequences_size(), 4);
  for (const v1::SampledSequence& s : got.prompts(0).sequences()) {
    ASSERT_EQ(s.tokens_size(), 6);
    const std::vector<float> want = ForwardLogprobs(&run, prompt, s);
    ASSERT_EQ(want.size(), 6u);
    for (int i = 0; i < 6; ++i) EXPECT_NEAR(s.logprobs(i), want[i], 1e-5) << "token " << i;
  }
}

TEST(SampleServiceTest, SavedAdaptersSampleAsTheRunDidThen) {
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("sample_saved"));
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server.address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 3));
  ASSERT_OK(run.TrainStep(Batch(0), Ppo(), Adam()).status());
  const v1::SampleRequest req = SampleOf(run.run_id(), {{5, 17, 3, 42, 9}, {1, 2, 3}}, 8, 1.0, 42, 2);
  ASSERT_OK_AND_ASSIGN(v1::SampleResponse then, client->Sample(req));
  const std::string dir = "lorastep://" + run.run_id();  // the server's state store
  v1::ExportAdapterRequest exported;
  exported.set_run_id(run.run_id());
  exported.set_path(dir + "/peft");
  ASSERT_OK(client->ExportAdapter(exported).status());
  v1::SaveStateRequest saved;
  saved.set_run_id(run.run_id());
  saved.set_path(dir + "/state");
  ASSERT_OK(client->SaveState(saved).status());
  ASSERT_OK(run.TrainStep(Batch(1), Ppo(), Adam()).status());
  auto tokens = [](const v1::SampleResponse& r) {
    std::vector<std::vector<int64_t>> out;
    for (const auto& p : r.prompts()) {
      for (const auto& s : p.sequences()) out.emplace_back(s.tokens().begin(), s.tokens().end());
    }
    return out;
  };
  for (const auto& [path, version] : std::vector<std::pair<std::string, int64_t>>{{dir + "/peft", 0}, {dir + "/state", 1}}) {
    v1::SampleRequest from = req;
    from.set_checkpoint(path);
    ASSERT_OK_AND_ASSIGN(v1::SampleResponse got, client->Sample(from));
    EXPECT_EQ(tokens(got), tokens(then)) << path;
    EXPECT_EQ(got.learner_version(), version) << path;
  }
  v1::SampleRequest both = req;
  both.set_checkpoint(dir + "/peft");
  both.set_base_model(true);
  EXPECT_THAT(client->Sample(both), StatusIs(absl::StatusCode::kInvalidArgument, "checkpoint"));
  v1::SampleRequest missing = req;
  missing.set_checkpoint(dir + "/nothing");
  absl::StatusOr<v1::SampleResponse> none = client->Sample(missing);
  EXPECT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), ::testing::HasSubstr("checkpoint"));
}

TEST(SampleServiceTest, BadRequestsAreRefusedNamingTheField) {
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("sample_bad"));
  ASSERT_OK_AND_ASSIGN(auto client, TrainerClient::Connect(server.address()));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(client.get(), Lora(), 3));
  auto refused = [&](const v1::SampleRequest& req, absl::StatusCode code, const std::string& field) {
    absl::StatusOr<v1::SampleResponse> got = client->Sample(req);
    EXPECT_EQ(got.status().code(), code) << field << ": " << got.status();
    EXPECT_NE(std::string(got.status().message()).find(field), std::string::npos) << got.status();
  };
  const auto ok = SampleOf(run.run_id(), {{1, 2}}, 4, 1.0, 1);
  refused(SampleOf(run.run_id(), {}, 4, 1.0, 1), absl::StatusCode::kInvalidArgument, "prompts");
  refused(SampleOf(run.run_id(), {{}}, 4, 1.0, 1), absl::StatusCode::kInvalidArgument, "prompts[0].prompt: empty");
  refused(SampleOf(run.run_id(), {{1, 2}, {3, 96}}, 4, 1.0, 1), absl::StatusCode::kInvalidArgument, "prompts[1].prompt[1]");
  refused(SampleOf(run.run_id(), {{1, 2}}, 0, 1.0, 1), absl::StatusCode::kInvalidArgument, "params.max_tokens");
  refused(SampleOf(run.run_id(), {{1, 2}}, 4, -1.0, 1), absl::StatusCode::kInvalidArgument, "params.temperature");
  refused(SampleOf(run.run_id(), {{1, 2}}, 4, 1.0, 1, 0), absl::StatusCode::kInvalidArgument, "num_samples");
  v1::SampleRequest top_p = ok;
  top_p.mutable_params()->set_top_p(0);
  refused(top_p, absl::StatusCode::kInvalidArgument, "params.top_p");
  refused(SampleOf("no-such-run", {{1, 2}}, 4, 1.0, 1), absl::StatusCode::kNotFound, "run_id");
  ASSERT_OK(client->Sample(ok).status());  // nothing above was left queued
}

TEST(SampleServiceTest, AnotherKeysRunIsNotFound) {
  const std::string dir = testing::ScratchDir("sample_keys");
  ASSERT_OK(WriteStringToFile(dir + "/keys", "key-a-0123456789abcdef owner-a\nkey-b-0123456789abcdef owner-b\n"));
  ASSERT_OK_AND_ASSIGN(ChildServer server, StartTinyCoordinator("sample_keys_model", {"--api_keys_file", dir + "/keys"}));
  ASSERT_OK_AND_ASSIGN(auto a, TrainerClient::Connect(server.address(), 30, "key-a-0123456789abcdef"));
  ASSERT_OK_AND_ASSIGN(auto b, TrainerClient::Connect(server.address(), 30, "key-b-0123456789abcdef"));
  ASSERT_OK_AND_ASSIGN(RunSession run, RunSession::Create(a.get(), Lora(), 3));
  ASSERT_OK(a->Sample(SampleOf(run.run_id(), {{1, 2}}, 2, 1.0, 1)).status());
  absl::StatusOr<v1::SampleResponse> other = b->Sample(SampleOf(run.run_id(), {{1, 2}}, 2, 1.0, 1));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound) << other.status();
}

}  // namespace
}  // namespace lorastep
