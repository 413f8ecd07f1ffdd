// A worker's state, without gRPC: one frozen base model on one device and the runs
// (adapter + optimizer state) trained over it. Runs never touch each other: each owns its
// Trainer; the base weights are shared read-only.
//
// Thread-safety: all methods may be called from any thread; calls are serialized (one
// device, one call at a time).
#ifndef LORASTEP_WORKER_WORKER_CORE_H_
#define LORASTEP_WORKER_WORKER_CORE_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/trainer.h"

namespace lorastep {

struct WorkerOptions {
  std::string model_path;
  std::string device = "cpu";
  std::string dtype;  // "" = config.json's
  int64_t max_tokens_per_microbatch = 8192;
  int64_t logprob_chunk_tokens = 1024;
  GradOptions grad;
};

class WorkerCore {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerCore>> Create(const WorkerOptions& options);

  const BaseModel& base() const { return *base_; }
  const WorkerOptions& options() const { return options_; }
  size_t num_runs() const;

  absl::Status CreateRun(const std::string& run_id, const LoraConfig& lora, uint64_t seed);
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const std::string& run_id,
                                                        const std::vector<Datum>& datums,
                                                        const LossConfig& loss,
                                                        const BatchTotals& totals);
  absl::StatusOr<ForwardBackwardResult> Forward(const std::string& run_id,
                                                const std::vector<Datum>& datums);
  absl::StatusOr<OptimStepResult> OptimStep(const std::string& run_id, const AdamWParams& params);
  absl::StatusOr<OptimStepResult> TrainStep(const std::string& run_id,
                                            const std::vector<Datum>& datums,
                                            const LossConfig& loss, const AdamWParams& params,
                                            const BatchTotals& totals, int64_t max_tokens);
  struct PathResult {
    std::string adapter_sha256;
    int64_t learner_version = 0;
  };
  absl::StatusOr<PathResult> SaveState(const std::string& run_id, const std::string& path);
  absl::StatusOr<PathResult> LoadState(const std::string& run_id, const std::string& path);
  absl::StatusOr<PathResult> ExportAdapter(const std::string& run_id, const std::string& path);

 private:
  WorkerCore(WorkerOptions options, std::shared_ptr<const BaseModel> base)
      : options_(std::move(options)), base_(std::move(base)) {}
  absl::StatusOr<Trainer*> Find(const std::string& run_id);  // requires mu_

  WorkerOptions options_;
  std::shared_ptr<const BaseModel> base_;
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Trainer>> runs_;
};

}  // namespace lorastep

#endif  // LORASTEP_WORKER_WORKER_CORE_H_
