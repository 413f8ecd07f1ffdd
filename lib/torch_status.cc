#include "lib/torch_status.h"

#include <c10/util/Exception.h>

#include <new>
#include <string>

#include "absl/strings/str_cat.h"

namespace lorastep {
namespace {

// c10 messages carry a long C++ backtrace after the first line; keep what a user reads.
std::string FirstLine(const char* what) {
  std::string s(what);
  auto pos = s.find('\n');
  return pos == std::string::npos ? s : s.substr(0, pos);
}

}  // namespace

absl::Status StatusFromCurrentException() {
  try {
    throw;
  } catch (const StatusError& e) {
    return e.status();
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory: ", FirstLine(e.what())));
  } catch (const c10::IndexError& e) {
    return absl::InvalidArgumentError(FirstLine(e.what_without_backtrace()));
  } catch (const c10::ValueError& e) {
    return absl::InvalidArgumentError(FirstLine(e.what_without_backtrace()));
  } catch (const c10::TypeError& e) {
    return absl::InvalidArgumentError(FirstLine(e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("torch: ", FirstLine(e.what_without_backtrace())));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of host memory");
  } catch (const std::exception& e) {
    return absl::InternalError(FirstLine(e.what()));
  } catch (...) {
    return absl::InternalError("unknown exception");
  }
}

}  // namespace lorastep
