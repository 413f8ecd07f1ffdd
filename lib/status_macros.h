// Error-propagation macros for absl::Status / absl::StatusOr, in the style of
// tensorstore's TENSORSTORE_RETURN_IF_ERROR and ASSIGN_OR_RETURN.
#ifndef LORASTEP_LIB_STATUS_MACROS_H_
#define LORASTEP_LIB_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LORASTEP_CONCAT_INNER_(a, b) a##b
#define LORASTEP_CONCAT_(a, b) LORASTEP_CONCAT_INNER_(a, b)

// Returns from the current function with the status of `expr` if it is not OK.
#define LORASTEP_RETURN_IF_ERROR(expr)              \
  do {                                              \
    ::absl::Status lorastep_status_ = (expr);       \
    if (!lorastep_status_.ok()) return lorastep_status_; \
  } while (false)

// `lhs = value of expr`, or returns its error status.
#define LORASTEP_ASSIGN_OR_RETURN(lhs, expr) \
  LORASTEP_ASSIGN_OR_RETURN_IMPL_(LORASTEP_CONCAT_(lorastep_statusor_, __LINE__), lhs, expr)

#define LORASTEP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // LORASTEP_LIB_STATUS_MACROS_H_
