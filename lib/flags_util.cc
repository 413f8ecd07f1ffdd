#include "lib/flags_util.h"

#include <cstdlib>
#include <iostream>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"

namespace lorastep {

void ParseCommandLineOrExit(int argc, char** argv, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  // absl's --help shows only flags defined in a file named after the program by default.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view) { return true; };
  config.contains_helpshort_flags = [](absl::string_view) { return true; };
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::cerr << argv[0] << ": unexpected argument '" << positional[1]
              << "' (flags are --name=value or --name value; see --help)\n";
    std::exit(2);
  }
}

}  // namespace lorastep
