// WorkerCore's sampling (worker_core.h): the worker's one SamplerEngine, stepped by the
// Sample calls that have requests in it.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "lib/device_stats.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"
#include "lib/training/activation_memory.h"
#include "worker/worker_core.h"

namespace lorastep {

absl::Status WorkerCore::EnsureSampler() {
  if (sampler_ != nullptr) return absl::OkStatus();
  const BaseModel& base = *base_;
  KvShape shape;
  shape.layers = static_cast<int64_t>(base.weights.layers.size());
  shape.first_layer = base.weights.first_layer;
  shape.kv_heads = base.shard.kv_heads > 0 ? base.shard.kv_heads : base.config.num_key_value_heads;
  shape.head_dim = base.config.head_dim();
  int64_t bytes = options_.kv_cache_bytes;
  if (bytes <= 0) {
    const int64_t available = base.device.is_cuda() ? CudaAvailableBytes(base.device) : AvailableHostMemoryBytes();
    bytes = std::min<int64_t>(std::max<int64_t>(available, 0) / 10, int64_t{4} << 30);
  }
  const int64_t blocks = bytes / KvBlockPool::BytesPerBlock(shape, base.dtype);
  if (blocks < 1) {
    return absl::ResourceExhaustedError(absl::StrCat("kv_cache_mb: ", bytes >> 20, " MiB holds no block of ",
                                                     shape.block_size, " positions for this model"));
  }
  LORASTEP_ASSIGN_OR_RETURN(KvBlockPool pool, KvBlockPool::Create(shape, blocks, base.dtype, base.device));
  kv_pool_ = std::make_unique<KvBlockPool>(std::move(pool));
  sampler_ = std::make_unique<SamplerEngine>(base.config, base.weights, kv_pool_.get(), SamplerOptions());
  return absl::OkStatus();
}

absl::StatusOr<WorkerCore::SampleOutcome> WorkerCore::Sample(const std::string& run_id, bool base_model,
                                                             std::vector<SampleRequest> requests,
                                                             const Cancelled& cancelled, const std::string& checkpoint) {
  const ParallelSizes& sizes = options_.sizes;
  if (sizes.tp > 1 || sizes.pp > 1 || sizes.cp > 1 || sizes.ep > 1) {
    return absl::FailedPreconditionError(
        "Sample: sampling with tp, pp, cp or ep > 1 is not built yet; a data-parallel replica (dp only) samples alone");
  }
  if (base_model && !checkpoint.empty()) {
    return absl::InvalidArgumentError("checkpoint: a saved adapter and base_model exclude each other");
  }
  SampleOutcome outcome;
  std::vector<int64_t> ids;
  std::unique_ptr<Trainer> saved;  // the checkpoint's adapter, for this call
  {
    std::lock_guard<FairMutex> device(mu_);
    const Adapter* adapter = nullptr;
    if (!base_model) {
      LORASTEP_ASSIGN_OR_RETURN(Trainer * trainer, Find(run_id));
      adapter = &trainer->adapter();
      outcome.learner_version = trainer->learner_version();
      if (!checkpoint.empty()) {
        // Loaded alone on this rank (no communicators: a data-parallel replica samples alone).
        TrainerOptions o;
        o.lora = trainer->adapter().lora_config();
        LORASTEP_ASSIGN_OR_RETURN(saved, Trainer::Create(base_, o));
        MeshVote local(nullptr, base_->device);
        // A SaveState checkpoint keeps its step count (the version reported); a PEFT folder has none.
        absl::StatusOr<std::string> folder = ResolvePath(run_id, checkpoint, /*write=*/false);
        const bool state = folder.ok() && PathExists(*folder + "/trainer_state.json");
        absl::Status loaded = InitRun(saved.get(), run_id, checkpoint, /*with_optimizer=*/state, &local);
        if (!loaded.ok()) {
          return absl::Status(loaded.code(), absl::StrReplaceAll(loaded.message(), {{"init_from", "checkpoint"}}));
        }
        adapter = &saved->adapter();
        outcome.learner_version = saved->learner_version();
      }
    }
    std::lock_guard<std::mutex> lock(sampler_mu_);
    LORASTEP_RETURN_IF_ERROR(EnsureSampler());
    for (size_t i = 0; i < requests.size(); ++i) {
      absl::StatusOr<int64_t> id = sampler_->Add(adapter, std::move(requests[i]));
      if (!id.ok()) {
        for (int64_t queued : ids) sampler_->Cancel(queued);
        return absl::Status(id.status().code(), absl::StrCat("prompts[", i, "].", id.status().message()));
      }
      ids.push_back(*id);
    }
  }
  outcome.results.resize(ids.size());
  std::vector<bool> have(ids.size(), false);
  while (true) {
    std::lock_guard<FairMutex> device(mu_);
    std::lock_guard<std::mutex> lock(sampler_mu_);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (have[i]) continue;
      if (std::optional<SampleResult> r = sampler_->Take(ids[i])) {
        outcome.results[i] = std::move(*r);
        have[i] = true;
      }
    }
    if (std::all_of(have.begin(), have.end(), [](bool b) { return b; })) return outcome;
    if (cancelled && cancelled()) {
      for (int64_t id : ids) sampler_->Cancel(id);
      return absl::CancelledError("Sample: cancelled (its caller went away or its deadline passed); its sequences were dropped");
    }
    absl::Status stepped = sampler_->Step();
    ++outcome.engine_steps;
    if (!stepped.ok()) {
      for (int64_t id : ids) sampler_->Cancel(id);
      return stepped;
    }
  }
}

WorkerCore::SamplerFigures WorkerCore::SamplerState() {
  std::lock_guard<std::mutex> lock(sampler_mu_);
  SamplerFigures f;
  if (kv_pool_ == nullptr) return f;
  f.kv_blocks = kv_pool_->total_blocks();
  f.kv_blocks_used = kv_pool_->total_blocks() - kv_pool_->free_blocks();
  f.running_sequences = sampler_->running_sequences();
  f.waiting_requests = sampler_->waiting_requests();
  return f;
}

}  // namespace lorastep
