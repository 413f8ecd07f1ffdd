// A real gloo mesh of threads in one process, for tests of collectives: each rank's thread
// forms its ProcessGroups through a file store and runs `body(rank, groups)`; the call
// returns when every rank is done, with each rank's status (a group that failed to form,
// an exception thrown by the body, or what the body returned).
#ifndef LORASTEP_TESTS_GLOO_THREADS_H_
#define LORASTEP_TESTS_GLOO_THREADS_H_

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/parallel/process_groups.h"
#include "tests/test_util.h"

namespace lorastep {
namespace testing {

inline std::vector<absl::Status> RunOnGlooThreads(const ParallelSizes& sizes, const std::string& name,
                                                  const std::function<absl::Status(int, ProcessGroups*)>& body) {
  const ParallelLayout layout = ParallelLayout::Create(sizes, sizes.world()).value();
  const std::string store = "file://" + ScratchDir(name) + "/store";
  std::vector<absl::Status> status(sizes.world(), absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  for (int r = 0; r < sizes.world(); ++r) {
    ranks.emplace_back([&, r] {
      ProcessGroupsOptions pg;
      pg.store_address = store;
      pg.rank = r;
      pg.layout = layout;
      pg.timeout = std::chrono::seconds(30);
      auto groups = ProcessGroups::Create(pg);
      if (!groups.ok()) {
        status[r] = groups.status();
        return;
      }
      try {
        status[r] = body(r, groups->get());
      } catch (const std::exception& e) {
        status[r] = absl::InternalError(e.what());
      }
    });
  }
  for (auto& t : ranks) t.join();
  return status;
}

}  // namespace testing
}  // namespace lorastep

#endif  // LORASTEP_TESTS_GLOO_THREADS_H_
