// A step's figures as Prometheus series, labelled by run: the same names on the coordinator
// (the whole mesh's merged metrics) and on each worker (its own rank's). docs/OPERATIONS.md
// lists them with meaning and unit.
#ifndef LORASTEP_RPC_STEP_METRICS_H_
#define LORASTEP_RPC_STEP_METRICS_H_

#include <cstdint>
#include <string>

#include <google/protobuf/map.h>

#include "lib/prometheus_registry.h"

namespace lorastep {

void DeclareStepMetrics(PrometheusRegistry* registry);
// `metrics`: the step's metric map (time_<phase>_s:sum, tokens_per_s:sum, mfu:sum,
// peak_cuda_memory_bytes:max, loss:sum, grad_norm:sum). `replicas_equal`: 1/0 on a mesh,
// -1 to leave the gauge alone. Published after the call's answer (RunAfterAnswer), on the
// thread that answered it; a scrape sees it microseconds later.
void RecordStepMetrics(PrometheusRegistry* registry, const std::string& run_id, const std::string& kind,
                       const google::protobuf::Map<std::string, double>& metrics, int64_t learner_version,
                       int replicas_equal = -1);

}  // namespace lorastep

#endif  // LORASTEP_RPC_STEP_METRICS_H_
