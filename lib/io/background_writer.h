// Writes that finish after the call that asked for them: one thread runs the submitted jobs
// in order, and callers can wait for the latest job under a key (a folder) and learn how it
// ended. Used for autosaves: the worker copies a run's state to host memory on the call's
// path and writes the folder here, so the disk never holds the device.
//
// Thread-safety: all methods from any thread. The destructor finishes every queued job.
#ifndef LORASTEP_LIB_IO_BACKGROUND_WRITER_H_
#define LORASTEP_LIB_IO_BACKGROUND_WRITER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"

namespace lorastep {

class BackgroundWriter {
 public:
  BackgroundWriter();
  ~BackgroundWriter();
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;

  void Submit(const std::string& key, std::function<absl::Status()> job);
  // Waits for the latest job submitted under `key` and returns how it ended; nullopt when
  // none was (or its outcome was forgotten: the outcomes of the last kKeptOutcomes keys are
  // kept).
  std::optional<absl::Status> Await(const std::string& key);
  // Jobs submitted and not finished yet.
  size_t pending() const;

  static constexpr size_t kKeptOutcomes = 1024;

 private:
  void Loop();

  struct Job {
    std::string key;
    int64_t serial;
    std::function<absl::Status()> run;
  };
  struct Outcome {
    int64_t serial = 0;                  // of the latest job under the key
    std::optional<absl::Status> status;  // set once that job finished
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;  // a job was queued or finished, or stopping
  std::deque<Job> queue_;
  std::map<std::string, Outcome> outcomes_;
  std::deque<std::pair<std::string, int64_t>> finished_order_;  // (key, serial) by finishing time
  int64_t next_serial_ = 1;
  size_t running_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_IO_BACKGROUND_WRITER_H_
