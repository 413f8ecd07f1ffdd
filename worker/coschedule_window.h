#ifndef LORASTEP_WORKER_COSCHEDULE_WINDOW_H_
#define LORASTEP_WORKER_COSCHEDULE_WINDOW_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace lorastep {

// How one run's calls come back to a co-scheduling worker: when its last co-scheduled step
// ended (its answer left) and how long its next call took to arrive after the answer before.
// A run that answers in lock step (an RL loop sending its next step as soon as the last one
// returns) has a short turnaround; one that rolls out between steps, a long one.
class RunReturns {
 public:
  using Clock = std::chrono::steady_clock;
  // The step that took the run's call ended at `at`.
  void Answered(Clock::time_point at) { answered_ = at; }
  // The run's next call arrived at `at` (turnaround measured when it follows an answer).
  void Arrived(Clock::time_point at) {
    if (answered_.has_value() && at >= *answered_) turnaround_ = at - *answered_;
  }
  const std::optional<Clock::time_point>& answered() const { return answered_; }
  const std::optional<Clock::duration>& turnaround() const { return turnaround_; }

 private:
  std::optional<Clock::time_point> answered_;
  std::optional<Clock::duration> turnaround_;
};

// When a co-scheduled step's window closes. It opened at `opened` (the device free for the
// step) and closes `window` past the latest arrival (`latest`, no earlier than `opened`; a call
// queued before the window opened arrives at its opening), never later than `opened + cap`.
// Expected runs with no call queued yet (`awaited`; the worker passes them where calls that
// waited through the previous step are queued) whose last turnaround fit within the cap hold
// it open until twice that turnaround plus `window` past their answer: on a busy host the runs
// of the last step may take longer than `window` to send again, and the window must not close
// on the previous step's stragglers alone. Runs of unknown or longer turnaround (back after
// their rollouts) hold nothing.
RunReturns::Clock::time_point CoscheduleWindowClose(RunReturns::Clock::time_point opened,
                                                    RunReturns::Clock::duration window,
                                                    RunReturns::Clock::duration cap,
                                                    RunReturns::Clock::time_point latest,
                                                    const std::vector<const RunReturns*>& awaited);

// A call waiting to be co-scheduled, as the step's choice sees it.
struct WaitingCall {
  std::string run;
  std::string tenant;  // lib/run_tenant.h
  int64_t tokens = 0;
};

// The device's shares for one co-scheduled step. A tenant is active when it has a call
// waiting or is in `expected_tenants` (mapped to the tokens of its last call). With one tenant
// active, every run's first waiting call is within its share. With several, the device is
// shared per tenant: each tenant's calls (one per run, in arrival order) are within its share
// while its tokens stay within the quantum, the largest first waiting call (for an expected
// tenant with none waiting, its last call) of any active tenant, and its first call always;
// a tenant with calls of other runs beyond that is heavy. A tenant with many runs then gets
// a step's share like a tenant with one, and a step stays near the longest single call of
// the tenants sharing it.
struct StepShares {
  size_t active_tenants = 0;
  std::vector<size_t> within;       // indices into `waiting`, arrival order
  std::set<std::string> heavy;      // tenants with waiting calls of other runs beyond their share
  std::set<std::string> tenants_of_within;
};
StepShares ShareStep(const std::vector<WaitingCall>& waiting, const std::map<std::string, int64_t>& expected_tenants);

// Which calls one step takes, and whether a heavy tenant's calls are among them. Heavy and
// light tenants take turns: after a step that served a heavy tenant, light tenants with calls
// waiting get a step of their own; after a light step, heavy tenants get theirs. Otherwise
// every call within its share. A light tenant's call then waits at most one heavy share's
// step and runs in a step of light calls only.
struct StepChoice {
  std::vector<size_t> taken;
  bool heavy = false;
};
StepChoice TakeForStep(const std::vector<WaitingCall>& waiting, const StepShares& shares, bool last_step_heavy);

// The expected runs (`expected`, of tenants `tenant_of`) a step's window waits for: those
// with no call waiting; none while a heavy tenant has calls waiting beyond its share (the
// device has work), and, when several tenants are active, no run of a tenant that has a call
// waiting (its share comes from the calls it has).
std::vector<std::string> RunsToAwait(const std::vector<WaitingCall>& waiting, const StepShares& shares,
                                     const std::set<std::string>& expected,
                                     const std::function<std::string(const std::string&)>& tenant_of);

}  // namespace lorastep

#endif  // LORASTEP_WORKER_COSCHEDULE_WINDOW_H_
