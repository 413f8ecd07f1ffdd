// The one place where LibTorch exceptions become absl::Status at the lib/ boundary:
// out of memory -> RESOURCE_EXHAUSTED, value/index/type errors -> INVALID_ARGUMENT,
// anything else -> INTERNAL.
#ifndef LORASTEP_LIB_TORCH_STATUS_H_
#define LORASTEP_LIB_TORCH_STATUS_H_

#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lorastep {

// Carries a status through code that can only throw (autograd backward, where a collective
// of the parallel engine fails); StatusFromCurrentException gives the status back unchanged.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

// Throws StatusError when `status` is not OK.
inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

// Converts the exception currently being handled (call inside a catch block).
absl::Status StatusFromCurrentException();

// Runs `fn` (returning absl::Status or absl::StatusOr<T>) and converts any torch exception.
template <typename Fn>
auto GuardTorch(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace lorastep

#endif  // LORASTEP_LIB_TORCH_STATUS_H_
