// The Tinker SDK's bodies in lorastep's terms, for the Tinker-compatible front
// (server/tinker_front.h): a forward_backward body's datums, its result, an optim_step's Adam
// parameters, and how a refusal is answered over HTTP. Pure conversions: no HTTP, no
// coordinator.
#ifndef LORASTEP_SERVER_TINKER_WIRE_H_
#define LORASTEP_SERVER_TINKER_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "lorastep/v1/trainer.pb.h"
#include "tinker/tinker_public.pb.h"

namespace lorastep {

// A forward_backward body's datums in lorastep's terms.
struct TinkerDatums {
  std::vector<v1::Datum> datums;
  // 0: one target per token. K: top-K targets ([N, K] target_tokens and weights, with
  // cross_entropy): each Tinker datum became K lorastep datums in a row, one per target column,
  // whose summed token losses are the top-K loss (at K times the compute of one target).
  int64_t top_k = 0;
};

// Each datum's encoded_text chunks joined into its tokens, and its `loss_fn_inputs` (FLOAT32
// `weights` / `logprobs` / `advantages`, INT64 or INT32 `target_tokens`; dense, or sparse CSR
// for two-dimensional ones) as the datum's fields. `loss_fn` decides which inputs are required
// (cross_entropy: target_tokens, weights defaulting to 1; the others: target_tokens, logprobs,
// advantages). INVALID_ARGUMENT naming `data[i].<field>` for anything else: image or audio
// chunks, a wrong dtype or row count, K outside 1-64 or differing between datums or inputs,
// two-dimensional inputs of another loss, an unknown input.
absl::StatusOr<TinkerDatums> DatumsFromTinker(const tinker_public::ForwardBackwardRequest& req);

// A forward_backward result: one record with each Tinker datum's "logprobs" (FLOAT32, one
// per token, or [N, K] for top-K targets), and the metrics whose keys have the SDK's
// `name:reduction` form (exactly one colon; others are left out, the SDK refuses them).
tinker_public::ForwardBackwardOutput TinkerForwardBackwardOutput(const v1::ForwardBackwardResponse& resp,
                                                                int64_t top_k = 0);

// An optim_step's `adam_params` as lorastep's AdamW, with the SDK's defaults for what is
// absent (learning_rate 1e-4, beta1 0.9, beta2 0.95, eps 1e-12, weight_decay 0,
// grad_clip_norm 0 = off). INVALID_ARGUMENT naming `adam_params.<key>` for a value that is
// not a finite number in range.
absl::StatusOr<v1::AdamWParams> AdamWFromTinker(const nlohmann::json& adam_params);

// A JSON object's metrics (numbers only) as the `metrics` of an optim_step result.
nlohmann::json TinkerMetrics(const google::protobuf::Map<std::string, double>& metrics);

// The HTTP status a refusal is answered with: 400 bad input (INVALID_ARGUMENT,
// FAILED_PRECONDITION, OUT_OF_RANGE, ALREADY_EXISTS), 401, 403, 404, 429 for a full queue
// (the SDK waits and sends again), 503 while the coordinator cannot serve, else 500.
int HttpStatusOf(const absl::Status& status);
// The other way, for counting and logging an answer like a gRPC call: the status an HTTP
// status stands for, with the body's "detail" as its message.
absl::Status StatusOfHttp(int http_status, const std::string& body);
// A failed future's category: "user" for the caller's own mistakes, else "server".
const char* FailureCategoryOf(const absl::Status& status);

}  // namespace lorastep

#endif  // LORASTEP_SERVER_TINKER_WIRE_H_
