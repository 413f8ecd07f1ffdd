// WorkerCore's sampling (worker_core.h): the worker's one SamplerEngine, stepped by the
// Sample calls that have requests in it.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "lib/device_stats.h"
#include "lib/io/file_util.h"
#include "lib/status_macros.h"
#include "lib/torch_status.h"
#include "lib/training/activation_memory.h"
#include "worker/worker_core.h"

namespace lorastep {

absl::Status WorkerCore::EnsureSampler() {
  if (sampler_ != nullptr) return absl::OkStatus();
  const BaseModel& base = *base_;
  // A tensor rank caches the key/value heads it attends with: its share, or the one head it
  // reads when the heads are replicated over the tensor group.
  const int64_t kv_heads = base.shard.kv_select >= 0 ? 1
                           : base.shard.kv_heads > 0 ? base.shard.kv_heads
                                                     : base.config.num_key_value_heads;
  const int64_t layers = static_cast<int64_t>(base.weights.layers.size());
  const KvShape shape = KvShapeFor(base.config, base.weights.first_layer, layers, kv_heads);
  int64_t bytes = options_.kv_cache_bytes;
  if (bytes <= 0) {
    const int64_t available = base.device.is_cuda() ? CudaAvailableBytes(base.device) : AvailableHostMemoryBytes();
    bytes = std::min<int64_t>(std::max<int64_t>(available, 0) / 10, int64_t{4} << 30);
  }
  // Linear-attention layers keep a state per sequence instead of blocks: the budget holds both.
  const int64_t state_bytes = RecurrentStateBytes(base.config, &base.shard, base.weights.first_layer, layers, base.dtype);
  const SamplingBudget budget =
      SplitSamplingBudget(bytes, KvBlockPool::BytesPerBlock(shape, base.dtype), shape.block_size, state_bytes,
                          std::min<int64_t>(2048, base.config.max_position_embeddings));
  if (budget.blocks < 1 || (state_bytes > 0 && budget.recurrent_sequences < 1)) {
    return absl::ResourceExhaustedError(absl::StrCat("kv_cache_mb: ", bytes >> 20, " MiB holds no block of ",
                                                     shape.block_size, " positions",
                                                     state_bytes > 0 ? " beside one sequence's linear-attention state"
                                                                     : "",
                                                     " for this model"));
  }
  LORASTEP_ASSIGN_OR_RETURN(KvBlockPool pool, KvBlockPool::Create(shape, budget.blocks, base.dtype, base.device));
  kv_pool_ = std::make_unique<KvBlockPool>(std::move(pool));
  SamplerOptions sampler_options;
  sampler_options.max_recurrent_sequences = budget.recurrent_sequences;
  sampler_ = std::make_unique<SamplerEngine>(base.config, base.weights, kv_pool_.get(), sampler_options,
                                             base.shard.tp > 1 ? &base.shard : nullptr);
  return absl::OkStatus();
}

absl::StatusOr<const Adapter*> WorkerCore::SamplingAdapter(const std::string& run_id, bool base_model,
                                                           const std::string& checkpoint,
                                                           std::unique_ptr<Trainer>* saved, int64_t* version) {
  if (base_model && !checkpoint.empty()) {
    return absl::InvalidArgumentError("checkpoint: a saved adapter and base_model exclude each other");
  }
  if (base_model) return nullptr;
  LORASTEP_ASSIGN_OR_RETURN(Trainer * trainer, Find(run_id));
  *version = trainer->learner_version();
  if (checkpoint.empty()) return &trainer->adapter();
  // Loaded for this call alone, into this rank's shard, without collectives.
  TrainerOptions o;
  o.lora = trainer->adapter().lora_config();
  LORASTEP_ASSIGN_OR_RETURN(*saved, Trainer::Create(base_, o));
  MeshVote local(nullptr, base_->device);
  // A SaveState checkpoint keeps its step count (the version reported); a PEFT folder has none.
  absl::StatusOr<std::string> folder = ResolvePath(run_id, checkpoint, /*write=*/false);
  const bool state = folder.ok() && PathExists(*folder + "/trainer_state.json");
  absl::Status loaded = InitRun(saved->get(), run_id, checkpoint, /*with_optimizer=*/state, &local);
  if (!loaded.ok()) {
    return absl::Status(loaded.code(), absl::StrReplaceAll(loaded.message(), {{"init_from", "checkpoint"}}));
  }
  *version = (*saved)->learner_version();
  return &(*saved)->adapter();
}

absl::StatusOr<WorkerCore::SampleOutcome> WorkerCore::Sample(const std::string& run_id, bool base_model,
                                                             std::vector<SampleRequest> requests,
                                                             const Cancelled& cancelled, const std::string& checkpoint,
                                                             const MeshCallInfo& mesh) {
  const ParallelSizes& sizes = options_.sizes;
  if (sizes.pp > 1 || sizes.cp > 1 || sizes.ep > 1) {
    return absl::FailedPreconditionError(
        "Sample: sampling with pp, cp or ep > 1 is not built yet; data-parallel and tensor-parallel meshes sample");
  }
  // Tensor ranks step their engines together: the whole mesh votes once that every rank is
  // ready, and each tensor group agrees on a cancel between steps.
  const bool tensor = sizes.tp > 1 && groups_ != nullptr;
  SampleOutcome outcome;
  std::vector<int64_t> ids;
  std::unique_ptr<Trainer> saved;  // the checkpoint's adapter, for this call
  CommGroup* tensor_group = nullptr;
  {
    std::lock_guard<FairMutex> device(mu_);
    std::lock_guard<std::mutex> lock(sampler_mu_);
    absl::Status ready = [&]() -> absl::Status {
      if (tensor) {
        LORASTEP_RETURN_IF_ERROR(FormGroups(mesh));
        tensor_group = &groups_->group(GroupKind::kTensor);
      }
      if (requests.empty()) return absl::OkStatus();  // a replica without a share: only its vote
      LORASTEP_ASSIGN_OR_RETURN(const Adapter* adapter,
                                SamplingAdapter(run_id, base_model, checkpoint, &saved, &outcome.learner_version));
      LORASTEP_RETURN_IF_ERROR(EnsureSampler());
      if (tensor && !sampler_->Idle()) {
        return absl::FailedPreconditionError("Sample: the engine of a tensor rank holds another call's requests");
      }
      for (size_t i = 0; i < requests.size(); ++i) {
        absl::StatusOr<int64_t> id = sampler_->Add(adapter, std::move(requests[i]));
        if (!id.ok()) return absl::Status(id.status().code(), absl::StrCat("prompts[", i, "].", id.status().message()));
        ids.push_back(*id);
      }
      return absl::OkStatus();
    }();
    if (tensor && !groups_->broken()) ready = AgreeOnMesh(groups_.get(), base_->device, ready);
    if (!ready.ok()) {
      for (int64_t queued : ids) sampler_->Cancel(queued);
      return ready;
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
    // A tensor group's ranks finish the same requests at the same step (they draw the same tokens).
    if (std::all_of(have.begin(), have.end(), [](bool b) { return b; })) return outcome;
    absl::StatusOr<bool> stop = SampleCancelled(cancelled, tensor ? tensor_group : nullptr, mesh.agree_on_cancel);
    if (!stop.ok() || *stop) {
      for (int64_t id : ids) sampler_->Cancel(id);
      if (!stop.ok()) return stop.status();
      return absl::CancelledError("Sample: cancelled (its caller went away or its deadline passed); its sequences were dropped");
    }
    absl::Status stepped = sampler_->Step(tensor_group);
    ++outcome.engine_steps;
    if (!stepped.ok()) {
      for (int64_t id : ids) sampler_->Cancel(id);
      return stepped;
    }
  }
}

absl::StatusOr<bool> WorkerCore::SampleCancelled(const Cancelled& cancelled, CommGroup* tensor_group,
                                                 bool agree_on_cancel) {
  if (tensor_group == nullptr) return cancelled && cancelled();
  if (!agree_on_cancel || !cancelled) return false;
  // Every rank of the group asks before the same step; any rank's yes stops them all there.
  return GuardTorch([&] { return AnyMemberSaysYes(*tensor_group, base_->device, cancelled()); });
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
