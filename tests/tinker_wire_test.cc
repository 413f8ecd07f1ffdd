// The Tinker front's body codecs (server/tinker_wire.h) and futures (server/tinker_futures.h):
// every refusal names its field, sparse inputs equal dense ones, top-K targets expand and come
// back in [N, K] order, and futures answer held polls, expire them and keep owners apart.
#include <cmath>
#include <cstring>
#include <future>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/tinker_futures.h"
#include "server/tinker_wire.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <typename T>
tinker_public::Tensor DenseOf(const std::vector<T>& v, tinker_public::DType dtype, const std::vector<int64_t>& shape) {
  tinker_public::Tensor t;
  t.set_dense(Bytes(v));
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

tinker_public::Tensor Dense(const std::vector<float>& v, const std::vector<int64_t>& shape = {}) {
  return DenseOf(v, tinker_public::DTYPE_FLOAT32, shape);
}

tinker_public::Tensor Tokens(const std::vector<int64_t>& v, const std::vector<int64_t>& shape = {}) {
  return DenseOf(v, tinker_public::DTYPE_INT64, shape);
}

tinker_public::Datum Text(const std::vector<int32_t>& tokens) {
  tinker_public::Datum d;
  d.add_model_input()->mutable_encoded_text()->set_tokens(Bytes(tokens));
  return d;
}

tinker_public::ForwardBackwardRequest Request(const std::string& loss_fn) {
  tinker_public::ForwardBackwardRequest r;
  r.set_loss_fn(loss_fn);
  return r;
}

TEST(TinkerWireTest, DatumsCarryTokensAndInputs) {
  auto req = Request("ppo");
  tinker_public::Datum* d = req.add_data();
  *d = Text({1, 2});
  d->add_model_input()->mutable_encoded_text()->set_tokens(Bytes(std::vector<int32_t>{3}));  // chunks join
  (*d->mutable_loss_fn_inputs())["target_tokens"] = Tokens({2, 3, 4});
  (*d->mutable_loss_fn_inputs())["logprobs"] = Dense({-1, -2, -3});
  (*d->mutable_loss_fn_inputs())["advantages"] = Dense({0.5, 0.5, -1});
  ASSERT_OK_AND_ASSIGN(TinkerDatums out, DatumsFromTinker(req));
  ASSERT_EQ(out.datums.size(), 1u);
  EXPECT_EQ(out.top_k, 0);
  EXPECT_THAT(out.datums[0].tokens(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_THAT(out.datums[0].target_tokens(), ::testing::ElementsAre(2, 3, 4));
  EXPECT_THAT(out.datums[0].logprobs(), ::testing::ElementsAre(-1, -2, -3));
  EXPECT_THAT(out.datums[0].advantages(), ::testing::ElementsAre(0.5, 0.5, -1));
}

TEST(TinkerWireTest, EveryRefusalNamesItsField) {
  struct Case {
    std::string loss;
    std::function<void(tinker_public::Datum*)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"cross_entropy", [](auto* d) { d->mutable_loss_fn_inputs()->erase("target_tokens"); },
       "data[0].loss_fn_inputs.target_tokens: required by loss_fn 'cross_entropy'"},
      {"ppo", [](auto*) {}, "data[0].loss_fn_inputs.logprobs: required by loss_fn 'ppo'"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["mask"] = Dense({1, 1}); },
       "data[0].loss_fn_inputs.mask: unknown input"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["weights"] = Tokens({1, 1}); },
       "data[0].loss_fn_inputs.weights: dtype int64, expected float32"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["weights"] = Dense({1, 1, 1}); },
       "data[0].loss_fn_inputs.weights: 3 values for 2 tokens"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["weights"] = Dense({1, 1}, {3}); },
       "data[0].loss_fn_inputs.weights: 3 rows for 2 tokens"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["weights"] = Dense({1, 1}, {2, 1, 1}); },
       "one or two dimensions are taken"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["target_tokens"] = Tokens(std::vector<int64_t>(130), {2, 65}); },
       "65 values per token; 1-64 are taken"},
      {"cross_entropy", [](auto* d) { (*d->mutable_loss_fn_inputs())["target_tokens"] = Tokens({1, 2, 3, 4}, {2, 2}); },
       "data[0].loss_fn_inputs.weights: 0 values per token, but target_tokens has 2"},
      {"cross_entropy", [](auto* d) { d->mutable_model_input(0)->mutable_image()->set_format("png"); },
       "data[0].model_input[0]: only encoded_text chunks"},
      {"cross_entropy", [](auto* d) { d->mutable_model_input(0)->mutable_encoded_text()->set_tokens("abc"); },
       "data[0].model_input[0].tokens: 3 bytes, not int32 values"},
      {"cross_entropy", [](auto* d) { d->clear_model_input(); }, "data[0].model_input: no tokens"},
  };
  for (const Case& c : cases) {
    auto req = Request(c.loss);
    tinker_public::Datum* d = req.add_data();
    *d = Text({5, 6});
    (*d->mutable_loss_fn_inputs())["target_tokens"] = Tokens({6, 7});
    (*d->mutable_loss_fn_inputs())["weights"] = Dense({0, 1});
    c.edit(d);
    EXPECT_THAT(DatumsFromTinker(req).status(), StatusIs(absl::StatusCode::kInvalidArgument, c.message)) << c.message;
  }
  EXPECT_THAT(DatumsFromTinker(Request("cross_entropy")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "data: no datums"));
}

// A 2 x 3 weight matrix with zeros, dense and as CSR; top-K targets of width 3.
TEST(TinkerWireTest, SparseEqualsDenseAndTopKExpandsByColumn) {
  const std::vector<float> w = {0.5, 0, 1, 0, 0, 2};
  tinker_public::Tensor sparse;
  sparse.set_dtype(tinker_public::DTYPE_FLOAT32);
  sparse.add_shape(2);
  sparse.add_shape(3);
  sparse.mutable_sparse_csr()->set_values(Bytes(std::vector<float>{0.5, 1, 2}));
  sparse.mutable_sparse_csr()->set_crow_indices(Bytes(std::vector<int64_t>{0, 2, 3}));
  sparse.mutable_sparse_csr()->set_col_indices(Bytes(std::vector<int64_t>{0, 2, 2}));
  auto build = [&](const tinker_public::Tensor& weights) {
    auto req = Request("cross_entropy");
    tinker_public::Datum* d = req.add_data();
    *d = Text({5, 6});
    (*d->mutable_loss_fn_inputs())["target_tokens"] = Tokens({10, 11, 12, 20, 21, 22}, {2, 3});
    (*d->mutable_loss_fn_inputs())["weights"] = weights;
    return req;
  };
  ASSERT_OK_AND_ASSIGN(TinkerDatums dense, DatumsFromTinker(build(Dense(w, {2, 3}))));
  ASSERT_OK_AND_ASSIGN(TinkerDatums from_sparse, DatumsFromTinker(build(sparse)));
  ASSERT_EQ(dense.top_k, 3);
  ASSERT_EQ(dense.datums.size(), 3u);  // one per target column
  for (int k = 0; k < 3; ++k) {
    EXPECT_THAT(dense.datums[k].tokens(), ::testing::ElementsAre(5, 6));
    EXPECT_THAT(dense.datums[k].target_tokens(), ::testing::ElementsAre(10 + k, 20 + k));
    EXPECT_THAT(dense.datums[k].weights(), ::testing::ElementsAre(w[k], w[3 + k]));
    EXPECT_THAT(from_sparse.datums[k].weights(), ::testing::ElementsAreArray(dense.datums[k].weights()));
  }
  // Malformed CSR: row pointers that do not cover the values, a column outside K.
  sparse.mutable_sparse_csr()->set_crow_indices(Bytes(std::vector<int64_t>{0, 2, 2}));
  EXPECT_THAT(DatumsFromTinker(build(sparse)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "sparse_csr: crow_indices, col_indices and values"));
  sparse.mutable_sparse_csr()->set_crow_indices(Bytes(std::vector<int64_t>{0, 2, 3}));
  sparse.mutable_sparse_csr()->set_col_indices(Bytes(std::vector<int64_t>{0, 3, 2}));
  EXPECT_THAT(DatumsFromTinker(build(sparse)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "sparse_csr: column 3 outside [0, 3)"));
  // The result comes back position-major, [N, K].
  v1::ForwardBackwardResponse resp;
  for (int k = 0; k < 3; ++k) {
    v1::TokenLogprobs* lp = resp.add_logprobs();
    lp->add_values(-1.0f - k);   // position 0, column k
    lp->add_values(-10.0f - k);  // position 1
  }
  (*resp.mutable_metrics())["loss:sum"] = 3;
  (*resp.mutable_metrics())["no_reduction"] = 1;
  (*resp.mutable_metrics())["a:b:c"] = 1;
  const tinker_public::ForwardBackwardOutput out = TinkerForwardBackwardOutput(resp, 3);
  const tinker_public::BatchedTensor& t = out.loss_fn_outputs(0).fields().at("logprobs");
  EXPECT_EQ(out.loss_fn_outputs(0).num_datums(), 1);
  EXPECT_THAT(t.trailing_shape(), ::testing::ElementsAre(3));
  std::vector<float> values(t.data().size() / 4);
  std::memcpy(values.data(), t.data().data(), t.data().size());
  EXPECT_THAT(values, ::testing::ElementsAre(-1, -2, -3, -10, -11, -12));
  EXPECT_EQ(out.metrics().size(), 1u) << "only name:reduction keys";
}

TEST(TinkerWireTest, AdamParametersAndStatuses) {
  ASSERT_OK_AND_ASSIGN(v1::AdamWParams defaults, AdamWFromTinker(nlohmann::json::object()));
  EXPECT_EQ(defaults.lr(), 1e-4);
  EXPECT_EQ(defaults.beta2(), 0.95);
  EXPECT_EQ(defaults.eps(), 1e-12);
  EXPECT_EQ(defaults.max_grad_norm(), 0);
  ASSERT_OK_AND_ASSIGN(v1::AdamWParams set, AdamWFromTinker({{"learning_rate", 0.01}, {"grad_clip_norm", 1.0}}));
  EXPECT_EQ(set.lr(), 0.01);
  EXPECT_EQ(set.max_grad_norm(), 1.0);
  EXPECT_THAT(AdamWFromTinker({{"beta1", "high"}}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "adam_params.beta1: expected a finite number"));
  EXPECT_THAT(AdamWFromTinker(nlohmann::json::array()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "adam_params: expected an object"));
  for (auto [code, http] : std::vector<std::pair<absl::StatusCode, int>>{
           {absl::StatusCode::kInvalidArgument, 400}, {absl::StatusCode::kUnauthenticated, 401},
           {absl::StatusCode::kPermissionDenied, 403}, {absl::StatusCode::kNotFound, 404},
           {absl::StatusCode::kResourceExhausted, 429}, {absl::StatusCode::kUnavailable, 503}}) {
    EXPECT_EQ(HttpStatusOf(absl::Status(code, "x")), http);
    EXPECT_EQ(StatusOfHttp(http, R"({"detail":"why"})"), absl::Status(code, "why"));
  }
  EXPECT_EQ(HttpStatusOf(absl::InternalError("x")), 500);
  EXPECT_STREQ(FailureCategoryOf(absl::InvalidArgumentError("x")), "user");
  EXPECT_STREQ(FailureCategoryOf(absl::InternalError("x")), "server");
}

TEST(TinkerFuturesTest, PollsAreHeldAnsweredExpiredAndKeptPerOwner) {
  TinkerFutureOptions options;
  options.poll_window = std::chrono::milliseconds(300);
  options.max_per_owner = 2;
  TinkerFutures futures(options);
  ASSERT_OK_AND_ASSIGN(std::string a, futures.Create("alice"));
  ASSERT_OK_AND_ASSIGN(std::string b, futures.Create("alice"));
  EXPECT_THAT(futures.Create("alice").status(),
              StatusIs(absl::StatusCode::kResourceExhausted, "--tinker_max_futures_per_key: 2"));
  EXPECT_TRUE(futures.Create("bob").ok()) << "another owner has a share of its own";
  std::promise<HttpAnswer> held;
  futures.Retrieve("alice", a, [&](HttpAnswer answer) { held.set_value(answer); });
  EXPECT_EQ(futures.held_polls(), 1u);
  futures.Finish(a, JsonAnswer(R"({"model_id":"m"})"));
  EXPECT_EQ(held.get_future().get().body, R"({"model_id":"m"})") << "a held poll gets the result";
  std::promise<HttpAnswer> expired;
  futures.Retrieve("alice", b, [&](HttpAnswer answer) { expired.set_value(answer); });
  const HttpAnswer try_again = expired.get_future().get();  // after the poll window
  EXPECT_EQ(nlohmann::json::parse(try_again.body)["type"], "try_again");
  HttpAnswer other;
  futures.Retrieve("bob", a, [&](HttpAnswer answer) { other = answer; });
  EXPECT_EQ(other.status, 404) << "another owner's future is not found";
  EXPECT_TRUE(futures.Create("alice").ok()) << "a finished future makes room";
  std::promise<HttpAnswer> stopping;
  futures.Retrieve("alice", b, [&](HttpAnswer answer) { stopping.set_value(answer); });
  futures.AnswerHeldPolls();
  EXPECT_EQ(nlohmann::json::parse(stopping.get_future().get().body)["type"], "try_again");
  EXPECT_EQ(futures.held_polls(), 0u);
}

}  // namespace
}  // namespace lorastep
