// Log lines through glog (Debian's absl has no absl/log): glog's prefix carries severity,
// time, thread and source location; the message is the caller's (the per-call lines are
// logfmt, docs/OPERATIONS.md). Only lib/log.cc includes glog, so files that include
// LibTorch (whose pip build defines its own LOG/CHECK macros) can log too.
//   LORASTEP_LOG(Info) << "serving " << path << " on port " << port;
#ifndef LORASTEP_LIB_LOG_H_
#define LORASTEP_LIB_LOG_H_

#include <sstream>

namespace lorastep {

enum class LogSeverity { kInfo, kWarning, kError };

// Logs to stderr only (no files), whatever glog's defaults; safe to call more than once and
// when a library (Debian's LibTorch) already initialized glog.
void InitLogging(const char* argv0);

// One log line, written through glog when it goes out of scope.
class LogLine {
 public:
  LogLine(LogSeverity severity, const char* file, int line) : severity_(severity), file_(file), line_(line) {}
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine();
  template <typename T>
  LogLine& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  LogSeverity severity_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace lorastep

#define LORASTEP_LOG(severity) ::lorastep::LogLine(::lorastep::LogSeverity::k##severity, __FILE__, __LINE__)

#endif  // LORASTEP_LIB_LOG_H_
