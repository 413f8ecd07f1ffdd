// Admission's shares: per key first (calls and bytes), then per run and in all; a refusal names
// the limit and leaves the counts as they were; a ticket gives back all it holds.
#include "server/admission.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "lib/prometheus_registry.h"

namespace lorastep {
namespace {

constexpr int64_t kMiB = 1 << 20;

AdmissionLimits Small() {
  AdmissionLimits l;
  l.calls_per_run = 2;
  l.calls_per_key = 4;
  l.calls_total = 6;
  l.bytes_per_key = 10 * kMiB;
  l.bytes_total = 16 * kMiB;
  return l;
}

void ExpectRefused(const absl::Status& s, const std::string& limit) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message().rfind(limit + ":", 0), 0u) << s;
}

TEST(AdmissionLimitsTest, AKeysShareMustLeaveRoomForTheOthers) {
  EXPECT_TRUE(AdmissionLimits().Check().ok());
  EXPECT_TRUE(Small().Check().ok());
  auto with = [](auto change) {
    AdmissionLimits l = Small();
    change(l);
    return l.Check();
  };
  auto named = [](const absl::Status& s, const std::string& flag) {
    return s.code() == absl::StatusCode::kInvalidArgument && s.message().rfind(flag + ":", 0) == 0;
  };
  EXPECT_TRUE(named(with([](AdmissionLimits& l) { l.calls_per_key = l.calls_total; }), "max_queued_per_key"));
  EXPECT_TRUE(named(with([](AdmissionLimits& l) { l.bytes_per_key = l.bytes_total; }), "max_queued_mb_per_key"));
  EXPECT_TRUE(named(with([](AdmissionLimits& l) { l.calls_per_run = 5; }), "max_queued_per_run"));
  EXPECT_TRUE(named(with([](AdmissionLimits& l) { l.calls_total = 0; }), "max_queued_per_run") ||
              named(with([](AdmissionLimits& l) { l.calls_total = 0; }), "max_queued"));
  EXPECT_TRUE(named(with([](AdmissionLimits& l) { l.bytes_total = -1; }), "max_queued_mb"));
}

// The issue this answers: one key at its limits used to leave every other key refused
// ("max_queued"). Now a key is refused at its own share and the others are still admitted.
TEST(AdmissionTest, AGreedyKeyIsRefusedAtItsShareAndOthersAreAdmitted) {
  PrometheusRegistry metrics;
  Admission admission(Small(), &metrics);
  std::vector<AdmissionTicket> greedy;
  for (int i = 0; i < 4; ++i) {
    auto t = admission.Admit("greedy", kMiB);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(t->JoinRun("greedy/run" + std::to_string(i % 2)).ok());
    greedy.push_back(*std::move(t));
  }
  ExpectRefused(admission.Admit("greedy", 0).status(), "max_queued_per_key");
  EXPECT_EQ(admission.OfKey("greedy").calls, 4);
  auto other = admission.Admit("other", kMiB);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(other->JoinRun("other/run").ok());
  EXPECT_EQ(admission.Total().calls, 5);
  EXPECT_EQ(admission.Total().bytes, 5 * kMiB);
  // The refusal is counted by limit, and the limits are published.
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("lorastep_admission_refused_total{limit=\"max_queued_per_key\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("lorastep_admission_limit{limit=\"max_queued_per_key\"} 4"), std::string::npos) << text;
  EXPECT_NE(text.find("lorastep_queue_depth 5"), std::string::npos) << text;
  greedy.clear();
  other->Release();
  EXPECT_EQ(admission.Total().calls, 0);
  EXPECT_EQ(admission.Total().bytes, 0);
  EXPECT_EQ(admission.CallsOfRun("greedy/run0"), 0);
}

TEST(AdmissionTest, BytesAreBoundedPerKeyThenInAll) {
  Admission admission(Small());
  auto a = admission.Admit("a", 9 * kMiB);
  ASSERT_TRUE(a.ok());
  ExpectRefused(admission.Admit("a", 2 * kMiB).status(), "max_queued_mb_per_key");
  auto b = admission.Admit("b", 6 * kMiB);
  ASSERT_TRUE(b.ok());
  // Both keys within their shares, the whole full: the refusal names the whole.
  ExpectRefused(admission.Admit("c", 2 * kMiB).status(), "max_queued_mb");
  EXPECT_EQ(admission.Total().bytes, 15 * kMiB);
  EXPECT_EQ(admission.OfKey("c").calls, 0) << "a refused key holds nothing";
  // A stream charged as it is read: refused past the key's share, nothing charged then.
  ExpectRefused(a->AddBytes(2 * kMiB), "max_queued_mb_per_key");
  EXPECT_EQ(admission.OfKey("a").bytes, 9 * kMiB);
  EXPECT_TRUE(a->AddBytes(kMiB).ok());
  EXPECT_EQ(admission.OfKey("a").bytes, 10 * kMiB);
  a->Release();
  a->Release();  // once only
  EXPECT_EQ(admission.Total().bytes, 6 * kMiB);
}

TEST(AdmissionTest, RunAndTotalCallsAreBounded) {
  AdmissionLimits l = Small();
  Admission admission(l);
  std::vector<AdmissionTicket> held;
  for (int i = 0; i < 2; ++i) {
    auto t = admission.Admit("k", 0);
    ASSERT_TRUE(t->JoinRun("r").ok());
    held.push_back(*std::move(t));
  }
  auto third = admission.Admit("k", 0);
  ASSERT_TRUE(third.ok());
  ExpectRefused(third->JoinRun("r"), "max_queued_per_run");
  third->Release();
  EXPECT_EQ(admission.OfKey("k").calls, 2) << "a call refused for its run gives its key's slot back";
  // Three keys of two calls each fill the whole (6); a fourth key is refused by the whole.
  for (const char* key : {"x", "y"}) {
    for (int i = 0; i < 2; ++i) held.push_back(*admission.Admit(key, 0));
  }
  ExpectRefused(admission.Admit("z", 0).status(), "max_queued");
  // Moving a ticket moves what it holds.
  AdmissionTicket moved = std::move(held.back());
  held.pop_back();
  EXPECT_EQ(admission.Total().calls, 6);
  moved = AdmissionTicket();
  EXPECT_EQ(admission.Total().calls, 5);
}

}  // namespace
}  // namespace lorastep
