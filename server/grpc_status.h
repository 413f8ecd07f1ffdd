// The one place where absl::Status and grpc::Status are converted (both directions).
#ifndef LORASTEP_SERVER_GRPC_STATUS_H_
#define LORASTEP_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace lorastep {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_GRPC_STATUS_H_
