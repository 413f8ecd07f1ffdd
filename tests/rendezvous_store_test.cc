// The rendezvous store of meshes across hosts: c10d's semantics on rank 0's host, limits that
// refuse by field and change nothing, and over a real gRPC server on loopback only callers
// with the cluster secret reach it (issue 26: c10d's TCPStore answered anyone).
#include "lib/parallel/rendezvous_store.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/bearer_token.h"
#include "rpc/call_authenticator.h"
#include "rpc/server_runner.h"
#include "tests/test_util.h"
#include "worker/rendezvous_service.h"

namespace lorastep {
namespace {

using ::lorastep::testing::StatusIs;
constexpr std::chrono::milliseconds kTimeout{5000};

StoreOp Op(StoreOp::Kind kind, std::vector<std::string> keys, std::string value = "", std::string expected = "",
           int64_t delta = 0) {
  StoreOp op;
  op.kind = kind;
  op.keys = std::move(keys);
  op.value = std::move(value);
  op.expected = std::move(expected);
  op.delta = delta;
  return op;
}

// set/get/add/compare_set/check/delete/num_keys as c10d's HashStore answers them.
void ExpectStoreSemantics(const StoreTransport& store) {
  ASSERT_OK_AND_ASSIGN(StoreAnswer missing, store(Op(StoreOp::kGet, {"a"}), kTimeout));
  EXPECT_FALSE(missing.found);
  ASSERT_OK(store(Op(StoreOp::kSet, {"a"}, std::string("x\0y", 3)), kTimeout).status());
  ASSERT_OK_AND_ASSIGN(StoreAnswer got, store(Op(StoreOp::kGet, {"a"}), kTimeout));
  EXPECT_TRUE(got.found);
  EXPECT_EQ(got.value, std::string("x\0y", 3));  // bytes, not C strings
  ASSERT_OK_AND_ASSIGN(StoreAnswer added, store(Op(StoreOp::kAdd, {"n"}, "", "", 3), kTimeout));
  EXPECT_EQ(added.number, 3);
  ASSERT_OK_AND_ASSIGN(added, store(Op(StoreOp::kAdd, {"n"}, "", "", -5), kTimeout));
  EXPECT_EQ(added.number, -2);
  EXPECT_THAT(store(Op(StoreOp::kAdd, {"a"}, "", "", 1), kTimeout).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "holds no counter"));
  // compare_set: an absent key is set only when `expected` is empty.
  ASSERT_OK_AND_ASSIGN(StoreAnswer cas, store(Op(StoreOp::kCompareSet, {"c"}, "new", "old"), kTimeout));
  EXPECT_EQ(cas.value, "old");
  ASSERT_OK_AND_ASSIGN(cas, store(Op(StoreOp::kCompareSet, {"c"}, "first", ""), kTimeout));
  EXPECT_EQ(cas.value, "first");
  ASSERT_OK_AND_ASSIGN(cas, store(Op(StoreOp::kCompareSet, {"c"}, "second", "wrong"), kTimeout));
  EXPECT_EQ(cas.value, "first");
  ASSERT_OK_AND_ASSIGN(cas, store(Op(StoreOp::kCompareSet, {"c"}, "second", "first"), kTimeout));
  EXPECT_EQ(cas.value, "second");
  ASSERT_OK_AND_ASSIGN(StoreAnswer check, store(Op(StoreOp::kCheck, {"a", "n", "c"}), kTimeout));
  EXPECT_TRUE(check.found);
  ASSERT_OK_AND_ASSIGN(check, store(Op(StoreOp::kCheck, {"a", "absent"}), kTimeout));
  EXPECT_FALSE(check.found);
  ASSERT_OK_AND_ASSIGN(StoreAnswer count, store(Op(StoreOp::kNumKeys, {}), kTimeout));
  EXPECT_EQ(count.number, 3);
  ASSERT_OK_AND_ASSIGN(StoreAnswer deleted, store(Op(StoreOp::kDeleteKey, {"a"}), kTimeout));
  EXPECT_TRUE(deleted.found);
  ASSERT_OK_AND_ASSIGN(deleted, store(Op(StoreOp::kDeleteKey, {"a"}), kTimeout));
  EXPECT_FALSE(deleted.found);
  ASSERT_OK_AND_ASSIGN(count, store(Op(StoreOp::kNumKeys, {}), kTimeout));
  EXPECT_EQ(count.number, 2);
}

TEST(RendezvousStoreTest, AnswersAsC10dStoresDo) {
  RendezvousStoreHost host;
  ExpectStoreSemantics(host.LocalTransport());
}

TEST(RendezvousStoreTest, RefusesMalformedAndOversizedOpsByFieldAndChangesNothing) {
  RendezvousStoreLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_keys = 3;
  limits.max_total_bytes = 40;
  limits.max_keys_per_op = 2;
  RendezvousStoreHost host(limits);
  EXPECT_THAT(host.Apply(Op(static_cast<StoreOp::Kind>(0), {"a"})), StatusIs(absl::StatusCode::kInvalidArgument, "kind"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {})), StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {"a", "b"})), StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kCheck, {"a", "b", "c"})), StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {""})), StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {"123456789"})), StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {"a"}, std::string(17, 'v'))),
              StatusIs(absl::StatusCode::kResourceExhausted, "value"));
  ASSERT_OK(host.Apply(Op(StoreOp::kSet, {"a"}, std::string(16, 'v'))).status());
  ASSERT_OK(host.Apply(Op(StoreOp::kSet, {"b"}, std::string(16, 'v'))).status());  // 34 bytes held
  EXPECT_THAT(host.Apply(Op(StoreOp::kSet, {"c"}, "123456")), StatusIs(absl::StatusCode::kResourceExhausted, "value"));
  EXPECT_THAT(host.Apply(Op(StoreOp::kCompareSet, {"c"}, "123456", "")),
              StatusIs(absl::StatusCode::kResourceExhausted, "value"));
  ASSERT_OK(host.Apply(Op(StoreOp::kSet, {"c"}, "1")).status());
  EXPECT_THAT(host.Apply(Op(StoreOp::kAdd, {"d"}, "", "", 1)), StatusIs(absl::StatusCode::kResourceExhausted, "keys"));
  // Replacing a value counts only the difference.
  ASSERT_OK(host.Apply(Op(StoreOp::kSet, {"a"}, "short")).status());
  ASSERT_OK_AND_ASSIGN(StoreAnswer count, host.Apply(Op(StoreOp::kNumKeys, {})));
  EXPECT_EQ(count.number, 3);
  ASSERT_OK_AND_ASSIGN(StoreAnswer a, host.Apply(Op(StoreOp::kGet, {"a"})));
  EXPECT_EQ(a.value, "short");
  ASSERT_OK_AND_ASSIGN(StoreAnswer c, host.Apply(Op(StoreOp::kGet, {"c"})));
  EXPECT_EQ(c.value, "1");
}

// Over gRPC on loopback, behind the cluster secret, as rank 0 serves it.
TEST(RendezvousStoreTest, OverGrpcOnlyCallersWithTheClusterSecretReachIt) {
  const std::string secret = "a-cluster-secret-of-enough-length";
  RendezvousStoreHost host;
  RendezvousStoreService service(&host);
  auto authenticator = std::make_shared<CallAuthenticator>();
  const std::string digest = Sha256Hex(secret);
  authenticator->Require("/lorastep.v1.RendezvousStore/",
                         [digest](const std::string& auth) { return CheckBearerToken(auth, digest); });
  int port = 0;
  ASSERT_OK_AND_ASSIGN(auto server, StartGrpcServer("127.0.0.1", 0, {&service}, &port, 4 << 20, CallObservers{},
                                                    nullptr, authenticator));
  const std::string address = "127.0.0.1:" + std::to_string(port);
  for (const std::string& authorization : {std::string(), std::string("Bearer wrong-secret"), "Basic " + secret}) {
    StoreTransport stranger = GrpcStoreTransport(address, grpc::InsecureChannelCredentials(), authorization);
    EXPECT_THAT(stranger(Op(StoreOp::kSet, {"gen0/world/0/rank_1"}, "evil"), kTimeout).status(),
                StatusIs(absl::StatusCode::kUnauthenticated, "")) << authorization;
    EXPECT_THAT(stranger(Op(StoreOp::kNumKeys, {}), kTimeout).status(), StatusIs(absl::StatusCode::kUnauthenticated, ""));
  }
  ASSERT_OK_AND_ASSIGN(StoreAnswer count, host.Apply(Op(StoreOp::kNumKeys, {})));
  EXPECT_EQ(count.number, 0) << "a caller without the secret changed the store";
  ExpectStoreSemantics(GrpcStoreTransport(address, grpc::InsecureChannelCredentials(), "Bearer " + secret));
  // Errors cross the wire with their code and field.
  StoreTransport member = GrpcStoreTransport(address, grpc::InsecureChannelCredentials(), "Bearer " + secret);
  EXPECT_THAT(member(Op(StoreOp::kSet, {std::string(2000, 'k')}), kTimeout).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "keys"));
  server->Shutdown();
}

}  // namespace
}  // namespace lorastep
