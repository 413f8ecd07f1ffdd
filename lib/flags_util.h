// Command-line parsing for every lorastep binary: absl flags, with --help listing all of a
// binary's flags, unknown flags and malformed values as errors naming the flag, and no
// positional arguments.
#ifndef LORASTEP_LIB_FLAGS_UTIL_H_
#define LORASTEP_LIB_FLAGS_UTIL_H_

namespace lorastep {

// Sets `usage` as the program's usage message and parses argv. --help (and its variants)
// prints every flag and exits (status 1, absl's convention); an unknown flag or a malformed
// value is reported by absl naming the flag (exit 1); a positional argument exits 2.
void ParseCommandLineOrExit(int argc, char** argv, const char* usage);

}  // namespace lorastep

#endif  // LORASTEP_LIB_FLAGS_UTIL_H_
