// Switches read from the environment, for side-by-side measurements of one build.
#ifndef LORASTEP_LIB_ENV_SWITCH_H_
#define LORASTEP_LIB_ENV_SWITCH_H_

#include <cstdlib>
#include <cstring>

namespace lorastep {

// Whether the switch `name` is on: it is unless the variable reads "0". Callers keep the
// answer in a function-local static, so the variable is read once per process.
inline bool EnvSwitchOn(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

}  // namespace lorastep

#endif  // LORASTEP_LIB_ENV_SWITCH_H_
