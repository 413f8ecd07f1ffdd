#include "lib/parent_death.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>

namespace lorastep {

void ExitWithSpawningParent() {
  const char* parent = std::getenv(kParentPidVariable);
  if (parent == nullptr) return;
  const pid_t expected = static_cast<pid_t>(std::atoi(parent));
  unsetenv(kParentPidVariable);  // not inherited by what this process starts
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (expected > 0 && getppid() != expected) _exit(1);  // the parent died before the signal was armed
}

}  // namespace lorastep
