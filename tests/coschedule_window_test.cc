// When a co-scheduled step's window closes, on made-up clocks (CoscheduleWindowClose).
#include "worker/coschedule_window.h"

#include <chrono>
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

}  // namespace
}  // namespace lorastep
