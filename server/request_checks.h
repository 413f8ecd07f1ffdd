// Checks of a trainer request's own fields that the coordinator makes before any work (the
// batch itself is checked by lib/training/batch.h's ValidateBatch).
#ifndef LORASTEP_SERVER_REQUEST_CHECKS_H_
#define LORASTEP_SERVER_REQUEST_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/map.h"
#include "lib/training/batch.h"
#include "lorastep/v1/trainer.pb.h"

namespace lorastep {

// client_metrics of a step request: at most 32, named plainly, finite (docs/API.md).
absl::Status ValidateClientMetrics(const google::protobuf::Map<std::string, double>& metrics);
// activation_recompute of a TrainStep / ForwardBackward: "" or one of ParseActivationRecompute's.
absl::Status CheckActivationRecompute(const std::string& value);
// Adds them to the step's metrics as client:<name>.
void AddClientMetrics(const google::protobuf::Map<std::string, double>& metrics, v1::StepResponse* resp);
// RESOURCE_EXHAUSTED naming max_response_bytes when a Forward(Backward) answer for
// `num_datums` datums of `num_targets` targets in all may exceed it (0: no limit);
// INVALID_ARGUMENT when it is negative.
absl::Status CheckResponseFits(int64_t num_datums, int64_t num_targets, int64_t max_bytes);
// The whole batch's denominators sent with one call of it (batch_totals): finite and at
// least the call's own; INVALID_ARGUMENT naming the field otherwise.
absl::Status ApplyWholeBatchTotals(const v1::BatchTotals& whole, BatchTotals* own);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_REQUEST_CHECKS_H_
