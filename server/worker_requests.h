// Small pieces of the coordinator's worker requests, shared by its parts.
#ifndef LORASTEP_SERVER_WORKER_REQUESTS_H_
#define LORASTEP_SERVER_WORKER_REQUESTS_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "lorastep/v1/worker.pb.h"

namespace lorastep {

// Milliseconds since the Unix epoch (the API's *_unix_ms fields).
inline int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A worker call on the state at `path` (a lorastep:// reference or a plain path) of a run.
inline v1::WorkerPathRequest PathRequest(const std::string& run_id, const std::string& path) {
  v1::WorkerPathRequest req;
  req.set_run_id(run_id);
  req.set_path(path);
  return req;
}

}  // namespace lorastep

#endif  // LORASTEP_SERVER_WORKER_REQUESTS_H_
