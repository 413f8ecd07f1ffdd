#include "lib/log.h"

#include <glog/logging.h>

namespace lorastep {

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;  // operators collect stderr; no files under /tmp
  if (!google::IsGoogleLoggingInitialized()) google::InitGoogleLogging(argv0);
}

LogLine::~LogLine() {
  const google::LogSeverity severity = severity_ == LogSeverity::kInfo      ? google::GLOG_INFO
                                       : severity_ == LogSeverity::kWarning ? google::GLOG_WARNING
                                                                            : google::GLOG_ERROR;
  google::LogMessage(file_, line_, severity).stream() << stream_.str();
}

}  // namespace lorastep
