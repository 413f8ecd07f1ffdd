// Local workers go with the coordinator that started them, however it dies. ChildServer
// starts a child with posix_spawn, which cannot arm the parent-death signal, so the child
// arms it itself, told its parent's pid through the environment.
#ifndef LORASTEP_LIB_PARENT_DEATH_H_
#define LORASTEP_LIB_PARENT_DEATH_H_

namespace lorastep {

// The environment variable a spawning parent sets to its pid.
inline constexpr char kParentPidVariable[] = "LORASTEP_PARENT_PID";

// In a process started with kParentPidVariable set: SIGTERM arrives when the thread that
// started this process exits (PR_SET_PDEATHSIG), and the process exits at once if that
// parent is already gone. Does nothing without the variable. Call first in a server's main.
void ExitWithSpawningParent();

}  // namespace lorastep

#endif  // LORASTEP_LIB_PARENT_DEATH_H_
