// The CPU GEMM peak the demo's model FLOP/s is compared with (bench/cpu_demo_bench.sh):
// fp32 at::mm of n x n by n x n on all of this machine's cores, median of 15 timings after
// warm-ups, for a few sizes; the best size's GFLOP/s is the peak.
//   mm_peak [--out F.json]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/flags/flag.h"
#include "lib/flags_util.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

ABSL_FLAG(std::string, out, "", "write the JSON result here");

int main(int argc, char** argv) {
  lorastep::ParseCommandLineOrExit(argc, argv, "mm_peak [--out F.json]");
  const std::string out = absl::GetFlag(FLAGS_out);
  double best = 0;
  int best_n = 0;
  std::string rows;
  for (int n : {256, 512, 1024, 2048}) {
    at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
    for (int w = 0; w < 3; ++w) at::mm(a, b);
    std::vector<double> t;
    for (int r = 0; r < 15; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      at::Tensor c = at::mm(a, b);
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    const double gflops = 2.0 * n * n * n / t[t.size() / 2] / 1e9;
    std::cout << "at::mm fp32 " << n << "^3: " << gflops << " GFLOP/s\n";
    rows += (rows.empty() ? "" : ", ") + std::string("\"") + std::to_string(n) + "\": " + std::to_string(gflops);
    if (gflops > best) best = gflops, best_n = n;
  }
  std::cout << "peak " << best << " GFLOP/s at n=" << best_n << " (" << at::get_num_threads() << " threads)\n";
  if (!out.empty()) {
    std::ofstream(out) << "{\"mm_peak_gflops\": " << best << ", \"peak_n\": " << best_n
                       << ", \"threads\": " << at::get_num_threads() << ", \"by_size_gflops\": {" << rows << "}}\n";
  }
  return 0;
}
