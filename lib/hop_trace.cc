#include "lib/hop_trace.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace lorastep {
namespace {

struct HopFile {
  std::mutex mu;
  FILE* file = nullptr;
};

HopFile& TheHopFile() {
  static HopFile* hops = [] {
    auto* h = new HopFile;  // lives as long as the process: marks may come from any thread at exit
    const char* dir = std::getenv("LORASTEP_HOP_TRACE_DIR");
    if (dir != nullptr && *dir != '\0') {
      const std::string path = std::string(dir) + "/" + std::to_string(getpid()) + ".log";
      h->file = std::fopen(path.c_str(), "a");
    }
    return h;
  }();
  return *hops;
}

}  // namespace

bool HopTraceOn() {
  static const bool on = TheHopFile().file != nullptr;
  return on;
}

void MarkHopSlow(std::string_view hop, std::string_view run) {
  const long long ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now().time_since_epoch())
                           .count();
  HopFile& h = TheHopFile();
  std::lock_guard<std::mutex> lock(h.mu);
  std::fprintf(h.file, "%lld %.*s %.*s\n", ns, static_cast<int>(hop.size()), hop.data(), static_cast<int>(run.size()),
               run.data());
  std::fflush(h.file);
}

}  // namespace lorastep
