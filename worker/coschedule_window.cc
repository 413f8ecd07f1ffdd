#include "worker/coschedule_window.h"

#include <algorithm>

namespace lorastep {

RunReturns::Clock::time_point CoscheduleWindowClose(RunReturns::Clock::time_point opened,
                                                    RunReturns::Clock::duration window,
                                                    RunReturns::Clock::duration cap,
                                                    RunReturns::Clock::time_point latest,
                                                    const std::vector<const RunReturns*>& awaited) {
  RunReturns::Clock::time_point close = std::max(latest, opened) + window;
  for (const RunReturns* run : awaited) {
    if (!run->answered().has_value() || !run->turnaround().has_value() || *run->turnaround() > cap) continue;
    close = std::max(close, *run->answered() + 2 * *run->turnaround() + window);
  }
  return std::min(close, opened + cap);
}

}  // namespace lorastep
