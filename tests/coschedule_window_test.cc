// When a co-scheduled step's window closes, on made-up clocks (CoscheduleWindowClose).
#include "worker/coschedule_window.h"

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lorastep {
namespace {

using Clock = RunReturns::Clock;
using std::chrono::milliseconds;

const Clock::time_point kOpened = Clock::time_point() + std::chrono::hours(1);
const milliseconds kWindow(5), kCap(40);

// A run whose last step ended at the window's opening and whose previous call followed its
// answer after `turnaround`.
RunReturns Returned(milliseconds turnaround) {
  RunReturns run;
  run.Answered(kOpened - std::chrono::seconds(1) - turnaround);
  run.Arrived(kOpened - std::chrono::seconds(1));
  run.Answered(kOpened);
  return run;
}

TEST(CoscheduleWindowTest, ClosesAWindowPastTheLatestArrivalWithinTheCap) {
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened, {}), kOpened + kWindow);
  // Calls queued before the window opened arrive at its opening.
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened - milliseconds(300), {}), kOpened + kWindow);
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened + milliseconds(12), {}),
            kOpened + milliseconds(17));
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened + milliseconds(38), {}), kOpened + kCap);
}

TEST(CoscheduleWindowTest, HoldsForRunsThatAnswerInLockStep) {
  // The last step's run came back 12 ms after its answer before: the window waits twice that
  // plus a window for it, though the stragglers queued alone would close it at 5 ms.
  const RunReturns lock_step = Returned(milliseconds(12));
  ASSERT_TRUE(lock_step.turnaround().has_value());
  EXPECT_EQ(*lock_step.turnaround(), milliseconds(12));
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened, {&lock_step}), kOpened + milliseconds(29));
  // Never past the cap.
  const RunReturns slower = Returned(milliseconds(30));
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened, {&lock_step, &slower}), kOpened + kCap);
  // Later arrivals still extend it.
  EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened + milliseconds(27), {&lock_step}),
            kOpened + milliseconds(32));
}

TEST(CoscheduleWindowTest, RunsBackAfterTheirRolloutsOrNeverSeenHoldNothing) {
  const RunReturns rollouts = Returned(milliseconds(900));  // turnaround past the cap
  const RunReturns created;                                 // no step yet
  RunReturns answered_once;                                 // one answer, no call since
  answered_once.Answered(kOpened);
  for (const RunReturns* run : std::vector<const RunReturns*>{&rollouts, &created, &answered_once}) {
    EXPECT_EQ(CoscheduleWindowClose(kOpened, kWindow, kCap, kOpened, {run}), kOpened + kWindow);
  }
  EXPECT_FALSE(created.turnaround().has_value());
  EXPECT_FALSE(answered_once.turnaround().has_value());
}

TEST(CoscheduleWindowTest, ATurnaroundIsMeasuredFromTheLastAnswer) {
  RunReturns run;
  run.Arrived(kOpened);  // before any answer: nothing measured
  EXPECT_FALSE(run.turnaround().has_value());
  run.Answered(kOpened + milliseconds(100));
  run.Arrived(kOpened + milliseconds(107));
  EXPECT_EQ(*run.turnaround(), milliseconds(7));
  run.Answered(kOpened + milliseconds(300));
  run.Arrived(kOpened + milliseconds(1300));  // back after its rollouts
  EXPECT_EQ(*run.turnaround(), milliseconds(1000));
  run.Arrived(kOpened + milliseconds(200));  // a call stamped before the answer measures nothing
  EXPECT_EQ(*run.turnaround(), milliseconds(1000));
}

// Issue 55: a co-scheduled step shares the device per tenant.
std::vector<size_t> Within(const std::vector<WaitingCall>& waiting, const std::map<std::string, int64_t>& expected) {
  return ShareStep(waiting, expected).within;
}

TEST(ShareStepTest, OneTenantTakesEveryRunsFirstCall) {
  const std::vector<WaitingCall> waiting = {{"r1", "", 64}, {"r2", "", 64}, {"r1", "", 64}, {"r3", "", 900}};
  EXPECT_EQ(Within(waiting, {}), (std::vector<size_t>{0, 1, 3}));
  EXPECT_EQ(Within(waiting, {{"", 64}}), (std::vector<size_t>{0, 1, 3})) << "its own expected runs change nothing";
  const StepShares shares = ShareStep(waiting, {});
  EXPECT_TRUE(shares.heavy.empty());
  EXPECT_EQ(TakeForStep(waiting, shares, false).taken, (std::vector<size_t>{0, 1, 3}));
}

TEST(ShareStepTest, ATenantWithManyRunsGetsAShareLikeATenantWithOne) {
  std::vector<WaitingCall> waiting;
  for (int r = 0; r < 64; ++r) waiting.push_back({"kgreedy." + std::to_string(r), "kgreedy", 64});
  waiting.push_back({"kother.run", "kother", 64});
  const StepShares shares = ShareStep(waiting, {});
  EXPECT_EQ(shares.within, (std::vector<size_t>{0, 64}));
  EXPECT_EQ(shares.heavy, (std::set<std::string>{"kgreedy"}));
  // Smaller calls: as many as fit the other tenant's call.
  for (auto& c : waiting) c.tokens = c.tenant == "kgreedy" ? 16 : 64;
  EXPECT_EQ(Within(waiting, {}), (std::vector<size_t>{0, 1, 2, 3, 64}));
}

TEST(ShareStepTest, AnExpectedTenantKeepsItsShareBeforeItsCallArrives) {
  std::vector<WaitingCall> waiting;
  for (int r = 0; r < 8; ++r) waiting.push_back({"kgreedy." + std::to_string(r), "kgreedy", 64});
  // The other tenant's run was in the last step (its last call 128 tokens) and has not sent
  // its next call yet: the greedy tenant takes 128 tokens' worth, not all eight runs.
  EXPECT_EQ(Within(waiting, {{"kother", 128}}), (std::vector<size_t>{0, 1}));
  // A first call larger than the quantum is still taken alone.
  waiting[0].tokens = 4096;
  EXPECT_EQ(Within(waiting, {{"kother", 128}}), (std::vector<size_t>{0}));
}

TEST(TakeForStepTest, HeavyAndLightTenantsTakeTurns) {
  std::vector<WaitingCall> waiting;
  for (int r = 0; r < 8; ++r) waiting.push_back({"kgreedy." + std::to_string(r), "kgreedy", 64});
  waiting.push_back({"kother.run", "kother", 64});
  waiting.push_back({"kthird.run", "kthird", 32});
  const StepShares shares = ShareStep(waiting, {});
  // After a heavy step the light tenants' calls run alone; after a light step, the heavy share.
  const StepChoice light = TakeForStep(waiting, shares, /*last_step_heavy=*/true);
  EXPECT_EQ(light.taken, (std::vector<size_t>{8, 9}));
  EXPECT_FALSE(light.heavy);
  const StepChoice heavy = TakeForStep(waiting, shares, /*last_step_heavy=*/false);
  EXPECT_EQ(heavy.taken, (std::vector<size_t>{0}));
  EXPECT_TRUE(heavy.heavy);
  // No light call waiting: the heavy share runs whatever the last step was.
  waiting.resize(8);
  EXPECT_EQ(TakeForStep(waiting, ShareStep(waiting, {{"kother", 64}}), true).taken, (std::vector<size_t>{0}));
}

TEST(RunsToAwaitTest, AWindowNeverIdlesTheDeviceForATenantThatHasCallsWaiting) {
  auto tenant_of = [](const std::string& run) { return run.substr(0, run.find('.')); };
  // One tenant: its expected runs without a call are awaited (they join the step).
  std::vector<WaitingCall> waiting = {{"a.1", "a", 64}};
  EXPECT_EQ(RunsToAwait(waiting, ShareStep(waiting, {}), {"a.1", "a.2"}, tenant_of), (std::vector<std::string>{"a.2"}));
  // Two light tenants: b's run is awaited; a's other run is not (a has a call waiting).
  waiting = {{"a.1", "a", 64}};
  EXPECT_EQ(RunsToAwait(waiting, ShareStep(waiting, {{"b", 64}}), {"a.2", "b.1"}, tenant_of),
            (std::vector<std::string>{"b.1"}));
  // A heavy tenant with calls beyond its share: nothing is awaited.
  waiting = {{"a.1", "a", 64}, {"a.2", "a", 64}};
  EXPECT_TRUE(RunsToAwait(waiting, ShareStep(waiting, {{"b", 64}}), {"b.1"}, tenant_of).empty());
}

}  // namespace
}  // namespace lorastep
