// Hop timestamps for benchmarks: with LORASTEP_HOP_TRACE_DIR set, each process appends
// "<steady-clock ns> <hop> <run>" lines to DIR/<pid>.log as a call passes the points its code
// marks (the client's send and receipt, the coordinator's entry and answer, the worker's
// queue, step end and answer). The steady clock is the machine's monotonic clock, shared by
// the processes of one host, so bench/hop_timeline.py lines the files up. Unset (the
// default), a mark is one branch on a flag read once.
#ifndef LORASTEP_LIB_HOP_TRACE_H_
#define LORASTEP_LIB_HOP_TRACE_H_

#include <string_view>

namespace lorastep {

// Whether LORASTEP_HOP_TRACE_DIR names a folder this process writes its hops to.
bool HopTraceOn();
// Records that `run`'s call passed `hop` now (no-op unless HopTraceOn()).
void MarkHopSlow(std::string_view hop, std::string_view run);
inline void MarkHop(std::string_view hop, std::string_view run) {
  if (HopTraceOn()) MarkHopSlow(hop, run);
}

}  // namespace lorastep

#endif  // LORASTEP_LIB_HOP_TRACE_H_
