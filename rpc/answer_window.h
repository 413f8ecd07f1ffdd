// When a call's answer is expected, from the same kind of call's recent durations. A caller
// that waits for a training step's answer polls for it inside this window instead of sleeping
// through it: a thread woken after sleeping through a 0.2 s step took ~1 ms more to run on
// the GPU host (its CPU idle states and cold caches), per hop of the service.
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
  struct Window {
    bool known = false;  // no call of the kind has finished yet: no window
    Clock::time_point opens, closes;
  };

  // The window of a call of `kind` (0 .. kKinds-1) started at `start`: from a little before
  // the shortest of the last three durations to a little after the longest (2% or 2 ms
  // before, whichever is more; 2% or 3 ms after).
  Window For(int kind, Clock::time_point start) const {
    int64_t shortest = 0, longest = 0;
    for (const auto& d : recent_ns_[kind]) {
      const int64_t ns = d.load(std::memory_order_relaxed);
      if (ns <= 0) continue;
      shortest = shortest == 0 ? ns : std::min(shortest, ns);
      longest = std::max(longest, ns);
    }
    Window w;
    if (shortest == 0) return w;
    w.known = true;
    w.opens = start + std::chrono::nanoseconds(shortest - std::max<int64_t>(2'000'000, shortest / 50));
    w.closes = start + std::chrono::nanoseconds(longest + std::max<int64_t>(3'000'000, longest / 50));
    return w;
  }
  // A call of `kind` answered after `took`.
  void Record(int kind, Clock::duration took) {
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
