// The flags every service benchmark client shares (where the coordinator listens, the
// vocabulary of its random batches, what its JSON result records about the run) and the
// result's head built from them.
#ifndef LORASTEP_BENCH_BENCH_FLAGS_H_
#define LORASTEP_BENCH_BENCH_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "bench/bench_stats.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "coordinator host:port");
ABSL_FLAG(int64_t, vocab, 96, "vocabulary size (random batches)");
ABSL_FLAG(std::string, machine, "unknown", "recorded in the JSON");
ABSL_FLAG(std::string, versions, "", "library versions, recorded in the JSON");
ABSL_FLAG(std::string, command, "", "the command, recorded in the JSON");
ABSL_FLAG(std::string, model, "", "the model, recorded in the JSON");
ABSL_FLAG(std::string, out, "", "write the JSON result here");

namespace lorastep {

// The head of a benchmark's JSON result: the date (UTC) and what the flags record.
inline nlohmann::ordered_json BenchResultHeader() {
  nlohmann::ordered_json j;
  j["date"] = UtcNowIso();
  j["machine"] = absl::GetFlag(FLAGS_machine);
  j["library_versions"] = absl::GetFlag(FLAGS_versions);
  j["command"] = absl::GetFlag(FLAGS_command);
  j["model"] = absl::GetFlag(FLAGS_model);
  return j;
}

}  // namespace lorastep

#endif  // LORASTEP_BENCH_BENCH_FLAGS_H_
