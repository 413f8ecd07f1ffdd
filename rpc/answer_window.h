// When a call's answer is expected, from the last three durations of calls of its kind. A
// caller waiting for a training step's answer polls for it inside that window instead of
// sleeping through it: on a virtual machine's idle CPU, a thread that blocked for the length
// of a step is woken later than one that polls (bench/host_costs.cc measures by how much),
// and each hop of an answer back to the client pays that. Before the window the caller
// blocks; after it, or when the durations spread too widely to say (a window wider than
// kMaxSpan), it blocks as any other caller does. The cost is at most the window of one core
// per call.
#ifndef LORASTEP_RPC_ANSWER_WINDOW_H_
#define LORASTEP_RPC_ANSWER_WINDOW_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace lorastep {

class AnswerWindows {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kKinds = 8;
  static constexpr std::chrono::milliseconds kMaxSpan{20};
  struct Window {
    bool known = false;  // no window: fewer than one call of the kind answered, or too spread
    Clock::time_point opens, closes;
  };

  // The window of a call of `kind` (0 .. kKinds-1; others have none) started at `start`: from
  // a little before the shortest of the last three durations to a little after the longest
  // (1% or 1 ms before, whichever is more; 1% or 2 ms after).
  Window For(int kind, Clock::time_point start) const {
    Window w;
    if (kind < 0 || kind >= kKinds) return w;
    int64_t shortest = 0, longest = 0;
    for (const auto& d : recent_ns_[kind]) {
      const int64_t ns = d.load(std::memory_order_relaxed);
      if (ns <= 0) continue;
      shortest = shortest == 0 ? ns : std::min(shortest, ns);
      longest = std::max(longest, ns);
    }
    if (shortest == 0) return w;
    const int64_t opens = shortest - std::max<int64_t>(1'000'000, shortest / 100);
    const int64_t closes = longest + std::max<int64_t>(2'000'000, longest / 100);
    if (closes - opens > std::chrono::duration_cast<std::chrono::nanoseconds>(kMaxSpan).count()) return w;
    w.known = true;
    w.opens = start + std::chrono::nanoseconds(opens);
    w.closes = start + std::chrono::nanoseconds(closes);
    return w;
  }

  // A call of `kind` answered `took` after it started.
  void Record(int kind, Clock::duration took) {
    if (kind < 0 || kind >= kKinds) return;
    const uint32_t slot = count_[kind].fetch_add(1, std::memory_order_relaxed) % 3;
    recent_ns_[kind][slot].store(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count(),
                                 std::memory_order_relaxed);
  }

 private:
  std::array<std::array<std::atomic<int64_t>, 3>, kKinds> recent_ns_{};
  std::array<std::atomic<uint32_t>, kKinds> count_{};
};

}  // namespace lorastep

#endif  // LORASTEP_RPC_ANSWER_WINDOW_H_
