// The flags every service benchmark client shares: where the coordinator listens, the
// vocabulary of its random batches, and what its JSON result records about the run.
#ifndef LORASTEP_BENCH_BENCH_FLAGS_H_
#define LORASTEP_BENCH_BENCH_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "coordinator host:port");
ABSL_FLAG(int64_t, vocab, 96, "vocabulary size (random batches)");
ABSL_FLAG(std::string, machine, "unknown", "recorded in the JSON");
ABSL_FLAG(std::string, versions, "", "library versions, recorded in the JSON");
ABSL_FLAG(std::string, command, "", "the command, recorded in the JSON");
ABSL_FLAG(std::string, model, "", "the model, recorded in the JSON");
ABSL_FLAG(std::string, out, "", "write the JSON result here");

#endif  // LORASTEP_BENCH_BENCH_FLAGS_H_
