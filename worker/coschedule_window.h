#ifndef LORASTEP_WORKER_COSCHEDULE_WINDOW_H_
#define LORASTEP_WORKER_COSCHEDULE_WINDOW_H_

#include <chrono>
#include <optional>
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

}  // namespace lorastep

#endif  // LORASTEP_WORKER_COSCHEDULE_WINDOW_H_
