#include "rpc/step_metrics.h"

#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "rpc/serial_executor.h"

namespace lorastep {

void DeclareStepMetrics(PrometheusRegistry* m) {
  using T = PrometheusRegistry::Type;
  m->Declare("lorastep_steps_total", T::kCounter,
             "optimizer steps recorded for a run, by call kind (train_step, optim_step)");
  m->Declare("lorastep_learner_version", T::kGauge, "optimizer steps applied to the run");
  m->Declare("lorastep_step_phase_seconds", T::kHistogram,
             "time of an optimizer step call by phase (step = the whole call), seconds; on the coordinator "
             "the slowest rank's",
             PrometheusRegistry::SecondsBuckets());
  m->Declare("lorastep_tokens_per_second", T::kGauge, "non-padding tokens per second of the run's last step");
  m->Declare("lorastep_mfu_ratio", T::kGauge,
             "model FLOPs utilization of the run's last step, 0-1 (CUDA: against the dense bf16 peak of the device, "
             "by its name; 0 for a device with no known peak)");
  m->Declare("lorastep_peak_cuda_memory_bytes", T::kGauge,
             "largest CUDA memory allocated during the run's last step, bytes");
  m->Declare("lorastep_loss", T::kGauge, "loss of the run's last step (its loss:sum metric)");
  m->Declare("lorastep_grad_norm", T::kGauge, "gradient norm before clipping of the run's last step");
  m->Declare("lorastep_co_scheduled_runs", T::kGauge,
             "co-scheduling: runs whose TrainSteps shared the run's last co-scheduled step");
  m->Declare("lorastep_co_scheduled_tokens", T::kGauge,
             "co-scheduling: non-padding tokens of every run in the run's last co-scheduled step");
  m->Declare("lorastep_co_scheduled_missed_runs", T::kGauge,
             "co-scheduling: runs the run's last co-scheduled step expected that sent no call in time");
  m->Declare("lorastep_replicas_equal", T::kGauge,
             "mesh: 1 when every replica of every family was bitwise equal after the run's last step, else 0");
}

namespace {

void PublishStepMetrics(PrometheusRegistry* m, const std::string& run_id, const std::string& kind,
                        const std::map<std::string, double>& metrics, int64_t learner_version, int replicas_equal) {
  const PrometheusRegistry::Labels run = {{"run", run_id}};
  m->Add("lorastep_steps_total", {{"run", run_id}, {"kind", kind}});
  m->Set("lorastep_learner_version", run, static_cast<double>(learner_version));
  for (const auto& [name, value] : metrics) {
    // time_<phase>_s:sum -> lorastep_step_phase_seconds{phase}
    if (absl::StartsWith(name, "time_") && absl::EndsWith(name, "_s:sum")) {
      const std::string phase = name.substr(5, name.size() - 5 - 6);
      m->Observe("lorastep_step_phase_seconds", {{"run", run_id}, {"phase", phase}}, value);
    }
  }
  const std::pair<const char*, const char*> gauges[] = {
      {"tokens_per_s:sum", "lorastep_tokens_per_second"}, {"mfu:sum", "lorastep_mfu_ratio"},
      {"peak_cuda_memory_bytes:max", "lorastep_peak_cuda_memory_bytes"}, {"loss:sum", "lorastep_loss"},
      {"grad_norm:sum", "lorastep_grad_norm"}, {"co_scheduled_runs:max", "lorastep_co_scheduled_runs"},
      {"co_scheduled_tokens:max", "lorastep_co_scheduled_tokens"},
      {"co_scheduled_missed_runs:max", "lorastep_co_scheduled_missed_runs"}};
  for (const auto& [metric, gauge] : gauges) {
    auto it = metrics.find(metric);
    if (it != metrics.end()) m->Set(gauge, run, it->second);
  }
  if (replicas_equal >= 0) m->Set("lorastep_replicas_equal", run, replicas_equal);
}

}  // namespace

void RecordStepMetrics(PrometheusRegistry* m, const std::string& run_id, const std::string& kind,
                       const google::protobuf::Map<std::string, double>& step_metrics, int64_t learner_version,
                       int replicas_equal) {
  if (m == nullptr) return;
  std::map<std::string, double> metrics(step_metrics.begin(), step_metrics.end());
  RunAfterAnswer([m, run_id, kind, metrics = std::move(metrics), learner_version, replicas_equal] {
    PublishStepMetrics(m, run_id, kind, metrics, learner_version, replicas_equal);
  });
}

}  // namespace lorastep
