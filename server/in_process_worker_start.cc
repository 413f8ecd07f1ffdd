#include "server/in_process_worker_start.h"

#include <ATen/Parallel.h>

#include "server/in_process_worker_client.h"
#include "worker/worker_core.h"

namespace lorastep {

absl::StatusOr<std::unique_ptr<WorkerClient>> StartInProcessWorker(const InProcessWorkerSettings& settings) {
  WorkerOptions options;
  options.model_path = settings.model;
  options.device = settings.device;
  options.dtype = settings.dtype;
  if (settings.max_tokens_per_microbatch) options.max_tokens_per_microbatch = *settings.max_tokens_per_microbatch;
  options.grad.fused_wgrad = !settings.unfused_wgrad;
  options.pack_sequences = settings.pack_sequences;
  options.state_dir = settings.state_dir;
  if (settings.max_activation_mb) options.max_activation_bytes = ActivationBytesFromMb(*settings.max_activation_mb);
  auto recompute = ParseActivationRecompute(settings.activation_recompute, "--activation_recompute");
  if (!recompute.ok()) return recompute.status();
  options.activation_recompute = *recompute;
  if (settings.coschedule_window_us < 0) {
    return absl::InvalidArgumentError("coschedule_window_us: must be >= 0 microseconds");
  }
  options.coschedule_window = std::chrono::microseconds(settings.coschedule_window_us);
  ProfileFromEnvironment(&options);
  if (settings.cpu_threads > 0) at::set_num_threads(settings.cpu_threads);
  auto client = InProcessWorkerClient::Create(options);
  if (!client.ok()) return client.status();
  return std::unique_ptr<WorkerClient>(std::move(client).value());
}

}  // namespace lorastep
