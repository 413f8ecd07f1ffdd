// Hop timestamps (lib/hop_trace.h) with LORASTEP_HOP_TRACE_DIR set before the first mark.
#include "lib/hop_trace.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace lorastep {
namespace {

TEST(HopTraceTest, MarksAppendTimeHopAndRunToThisProcesssFile) {
  const std::string dir = lorastep::testing::ScratchDir("hop_trace");
  ASSERT_EQ(setenv("LORASTEP_HOP_TRACE_DIR", dir.c_str(), 1), 0);
  ASSERT_TRUE(HopTraceOn());
  MarkHop("client_sent", "run-1");
  MarkHop("worker_queued", "run-1");
  std::ifstream file(dir + "/" + std::to_string(getpid()) + ".log");
  ASSERT_TRUE(file.good());
  std::vector<std::string> hops;
  long long last = 0;
  for (long long ns; file >> ns;) {
    std::string hop, run;
    file >> hop >> run;
    EXPECT_GE(ns, last);  // the steady clock, in order
    last = ns;
    EXPECT_EQ(run, "run-1");
    hops.push_back(hop);
  }
  EXPECT_EQ(hops, (std::vector<std::string>{"client_sent", "worker_queued"}));
}

}  // namespace
}  // namespace lorastep
