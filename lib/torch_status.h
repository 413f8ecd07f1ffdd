// The one place where LibTorch exceptions become absl::Status at the lib/ boundary:
// out of memory -> RESOURCE_EXHAUSTED, value/index/type errors -> INVALID_ARGUMENT,
// anything else -> INTERNAL.
#ifndef LORASTEP_LIB_TORCH_STATUS_H_
#define LORASTEP_LIB_TORCH_STATUS_H_

#include <exception>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lorastep {

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
