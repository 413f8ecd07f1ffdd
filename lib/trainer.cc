#include "lib/trainer.h"
#include <ATen/core/grad_mode.h>

#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "lib/checkpoint_dir.h"
#include "lib/digest.h"
#include "lib/file_util.h"
#include "lib/grad_finalizer.h"
#include "lib/logprobs.h"
#include "lib/losses.h"
#include "lib/peft_io.h"
#include "lib/qwen2.h"
#include "lib/safetensors.h"
#include "lib/status_macros.h"
#include "lib/tensor_bytes.h"
#include "lib/torch_compat.h"
#include "lib/torch_status.h"
#include "nlohmann/json.hpp"

namespace lorastep {
namespace {

constexpr int kStateFormatVersion = 1;
constexpr double kH200DenseBf16Flops = 989e12;  // datasheet; MFU's denominator on CUDA

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

at::Tensor FloatsOrUndefined(const std::vector<const std::vector<float>*>& parts, bool any) {
  if (!any) return at::Tensor();
  std::vector<float> flat;
  for (const auto* p : parts) flat.insert(flat.end(), p->begin(), p->end());
  return at::tensor(flat, at::kFloat);
}

// Model FLOPs of a datum of n tokens: matmul FLOPs per token times n, plus causal attention
// (QK^T and AV, 2*2*d per query-key pair, n(n+1)/2 pairs per layer). `passes`: 1 forward,
// 2 forward + dgrad (LoRA: frozen weights have no wgrad), 3 forward + dgrad + wgrad.
double DatumFlops(const ModelConfig& c, int64_t n, double matmul_passes, double lora_params) {
  const double attn_pairs = 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  const double attn_fwd = 4.0 * c.num_hidden_layers * c.hidden_size * attn_pairs;
  const double attn_passes = matmul_passes > 1 ? 3.0 : 1.0;  // backward of attention is 2x
  return 2.0 * matmul_passes * static_cast<double>(c.MatmulParameterCount()) * n +
         (matmul_passes > 1 ? 6.0 : 2.0) * lora_params * n + attn_passes * attn_fwd;
}

double PeakHostMemoryBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const BaseModel>> LoadBaseModel(const std::string& folder,
                                                               const std::string& device,
                                                               const std::string& dtype,
                                                               const ParallelSizes& sizes,
                                                               const RankCoords& coords) {
  return GuardTorch([&]() -> absl::StatusOr<std::shared_ptr<const BaseModel>> {
    auto base = std::make_shared<BaseModel>();
    base->path = folder;
    base->device = at::Device(device);
    c10::optional<at::ScalarType> type;
    if (!dtype.empty()) {
      LORASTEP_ASSIGN_OR_RETURN(at::ScalarType t, ScalarTypeFromName(dtype));
      type = t;
    }
    LORASTEP_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(folder, base->device, type));
    base->config = loaded.config;
    LORASTEP_RETURN_IF_ERROR(ValidateLayoutForModel(sizes, base->config));
    base->shard = MakeModelShard(sizes, coords, base->config);
    base->weights = ShardModelWeights(loaded.weights, base->config, base->shard);
    loaded.weights = ModelWeights();
    base->dtype = base->weights.embed_tokens.scalar_type();
    return std::shared_ptr<const BaseModel>(base);
  });
}

Trainer::Trainer(std::shared_ptr<const BaseModel> base, const TrainerOptions& options,
                 Adapter adapter)
    : base_(std::move(base)),
      options_(options),
      adapter_(std::make_unique<Adapter>(std::move(adapter))),
      dropout_generator_(at::make_generator<at::CPUGeneratorImpl>(options.seed ^ 0x5eedd0d0ull)) {
  optimizer_ = std::make_unique<AdamW>(adapter_.get());
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(std::shared_ptr<const BaseModel> base,
                                                         const TrainerOptions& options) {
  if (base == nullptr) return absl::InvalidArgumentError("base: no model");
  LORASTEP_RETURN_IF_ERROR(ValidateLoraConfig(options.lora));
  if (options.max_tokens_per_microbatch <= 0) {
    return absl::InvalidArgumentError("max_tokens_per_microbatch: must be > 0");
  }
  if (options.logprob_chunk_tokens <= 0) {
    return absl::InvalidArgumentError("logprob_chunk_tokens: must be > 0");
  }
  return GuardTorch([&]() -> absl::StatusOr<std::unique_ptr<Trainer>> {
    Adapter adapter;
    if (options.lora.full_finetune()) {
      adapter = Adapter::CreateFullFinetune(base->weights);
    } else {
      LORASTEP_ASSIGN_OR_RETURN(adapter, Adapter::CreateLora(base->config, options.lora,
                                                             base->device, base->dtype,
                                                             options.seed, &base->shard));
    }
    return std::unique_ptr<Trainer>(new Trainer(base, options, std::move(adapter)));
  });
}

void Trainer::SyncDevice() const {
  // A device-to-host copy waits for all work queued on the current stream.
  if (base_->device.is_cuda()) at::zeros({1}, at::TensorOptions().device(base_->device)).item<float>();
}

std::string Trainer::AdapterSha256() const {
  std::vector<at::Tensor> values;
  for (const Parameter& p : adapter_->parameters()) values.push_back(p.value);
  return TensorsSha256(values);
}

absl::StatusOr<ForwardBackwardResult> Trainer::RunMicroBatches(const std::vector<Datum>& datums,
                                                               const LossConfig* loss,
                                                               const BatchOptions& batch) {
  const ModelConfig& config = base_->config;
  const bool backward = loss != nullptr;
  ForwardBackwardResult result;
  Metrics& m = result.metrics;
  result.logprobs.resize(datums.size());

  // Batch-wide denominators, so micro-batch losses sum to the batch loss.
  LossDenominators den;
  std::vector<float> sample_tokens(datums.size(), 0.0f);
  double physical = 0;
  for (size_t d = 0; d < datums.size(); ++d) {
    for (size_t i = 0; i < datums[d].tokens.size(); ++i) {
      if (LossMask(datums[d], i) != 0) sample_tokens[d] += 1;
    }
    den.loss_tokens += sample_tokens[d];
    if (sample_tokens[d] > 0) den.samples += 1;
  }
  den.sample_tokens = at::tensor(sample_tokens, at::kFloat);
  if (batch.totals != nullptr) {
    den.loss_tokens = batch.totals->loss_tokens;
    den.samples = batch.totals->samples;
  }

  const auto micro_batches = SplitIntoMicroBatches(
      datums, batch.max_tokens_per_microbatch > 0 ? batch.max_tokens_per_microbatch
                                                  : options_.max_tokens_per_microbatch);
  ForwardOptions fwd_options{options_.grad, /*training=*/backward, &dropout_generator_};
  CommGroup* tensor_group = options_.groups != nullptr && base_->shard.tp > 1
                                ? &options_.groups->group(GroupKind::kTensor)
                                : nullptr;
  if (tensor_group != nullptr) {
    fwd_options.shard = &base_->shard;
    fwd_options.tensor_group = tensor_group;
  }
  const VocabShard vocab{tensor_group, base_->shard.vocab_begin};
  double t_data = 0, t_forward = 0, t_backward = 0, flops = 0, real_tokens = 0;
  const double lora_params = adapter_->full_finetune()
                                 ? 0.0
                                 : [&] {
                                     double n = 0;
                                     for (const auto& p : adapter_->parameters()) n += p.value.numel();
                                     return n;
                                   }();
  const double matmul_passes = !backward ? 1.0 : adapter_->full_finetune() ? 3.0 : 2.0;

  for (const auto& mb : micro_batches) {
    auto t0 = Clock::now();
    int64_t longest = 0;
    for (size_t d : mb) longest = std::max<int64_t>(longest, datums[d].tokens.size());
    const int64_t b = static_cast<int64_t>(mb.size());
    std::vector<int64_t> tokens(b * longest, 0), positions, targets, sample_of;
    std::vector<float> mask;
    std::vector<const std::vector<float>*> adv, samp, old, ref;
    for (int64_t r = 0; r < b; ++r) {
      const Datum& datum = datums[mb[r]];
      const int64_t n = static_cast<int64_t>(datum.tokens.size());
      for (int64_t i = 0; i < n; ++i) {
        tokens[r * longest + i] = datum.tokens[i];
        positions.push_back(r * longest + i);
        targets.push_back(datum.target_tokens[i]);
        sample_of.push_back(static_cast<int64_t>(mb[r]));
        mask.push_back(LossMask(datum, i));
      }
      adv.push_back(&datum.advantages);
      samp.push_back(&datum.logprobs);
      old.push_back(&datum.old_logprobs);
      ref.push_back(&datum.ref_logprobs);
      physical += static_cast<double>(longest);
      real_tokens += static_cast<double>(n);
      flops += DatumFlops(config, n, matmul_passes, lora_params);
    }
    const auto device = base_->device;
    at::Tensor tokens_t = at::tensor(tokens, at::kLong).view({b, longest}).to(device);
    at::Tensor positions_t = at::tensor(positions, at::kLong).to(device);
    at::Tensor targets_t = at::tensor(targets, at::kLong).to(device);
    t_data += SecondsSince(t0);

    t0 = Clock::now();
    c10::optional<at::NoGradGuard> no_grad;
    if (!backward) no_grad.emplace();
    at::Tensor hidden = Qwen2Hidden(config, base_->weights, adapter_.get(), tokens_t, fwd_options);
    at::Tensor selected = FoldLeadingDims(hidden).index_select(0, positions_t);
    TokenScores scores =
        ChunkedTokenScores(selected, OutputWeight(base_->weights, adapter_.get()),
                           OutputMainGrad(adapter_.get()), targets_t,
                           options_.logprob_chunk_tokens, options_.grad, vocab);
    at::Tensor lp_cpu = scores.logprobs.detach().to(at::kCPU);
    {
      const float* lp = lp_cpu.data_ptr<float>();
      size_t offset = 0;
      for (size_t d : mb) {
        result.logprobs[d].assign(lp + offset, lp + offset + datums[d].tokens.size());
        offset += datums[d].tokens.size();
      }
    }
    at::Tensor loss_value;
    if (backward) {
      auto any = [](const std::vector<const std::vector<float>*>& v) {
        for (const auto* p : v) if (!p->empty()) return true;
        return false;
      };
      LossInputs in;
      in.logprobs = scores.logprobs;
      in.entropy = scores.entropy;
      in.mask = at::tensor(mask, at::kFloat).to(device);
      in.sample_index = at::tensor(sample_of, at::kLong).to(device);
      in.advantages = FloatsOrUndefined(adv, any(adv));
      in.sampler_logprobs = FloatsOrUndefined(samp, any(samp));
      in.old_logprobs = FloatsOrUndefined(old, any(old));
      in.ref_logprobs = FloatsOrUndefined(ref, any(ref));
      for (at::Tensor* t : {&in.advantages, &in.sampler_logprobs, &in.old_logprobs, &in.ref_logprobs}) {
        if (t->defined()) *t = t->to(device);
      }
      LossDenominators mb_den = den;
      mb_den.sample_tokens = den.sample_tokens.to(device);
      loss_value = ComputeLoss(*loss, in, mb_den, &m);
    } else {
      at::Tensor bearing = (at::tensor(mask, at::kFloat) != 0).to(at::kDouble);
      m.Add("entropy:mean", (scores.entropy.detach().to(at::kCPU).to(at::kDouble) * bearing).sum().item<double>(),
            bearing.sum().item<double>());
    }
    SyncDevice();
    t_forward += SecondsSince(t0);

    if (backward) {
      t0 = Clock::now();
      loss_value.backward();
      SyncDevice();
      t_backward += SecondsSince(t0);
    }
  }
  m.Add("tokens_physical:sum", physical);
  m.Add("tokens_nonpadding:sum", real_tokens);
  m.Add("tokens_loss:sum", den.loss_tokens);
  m.Add("micro_batches:sum", static_cast<double>(micro_batches.size()));
  m.Add("time_data_s:sum", t_data);
  m.Add("time_forward_s:sum", t_forward);
  if (backward) m.Add("time_backward_s:sum", t_backward);
  const double compute_s = t_forward + t_backward;
  m.Add("model_flops:sum", flops);
  if (compute_s > 0) m.Add("tokens_per_s:sum", real_tokens / compute_s);
  const double peak = options_.peak_flops > 0 ? options_.peak_flops
                                              : (base_->device.is_cuda() ? kH200DenseBf16Flops : 0);
  if (peak > 0 && compute_s > 0) m.Add("mfu:sum", flops / compute_s / peak);
  m.Set("peak_host_memory_bytes:max", PeakHostMemoryBytes());
  return result;
}

absl::StatusOr<Trainer::CallSnapshot> Trainer::Snapshot() {
  if (pending_backward_calls_ > 0) LORASTEP_RETURN_IF_ERROR(FoldLocalGradients(adapter_.get()));
  return GuardTorch([&]() -> absl::StatusOr<CallSnapshot> {
    CallSnapshot snapshot;
    snapshot.pending_backward_calls = pending_backward_calls_;
    snapshot.dropout_rng = dropout_generator_.get_state();
    if (pending_backward_calls_ > 0) {  // else nothing accumulated: undo = zero
      for (const Parameter& p : adapter_->parameters()) snapshot.main_grads.push_back(p.main_grad.clone());
    }
    return snapshot;
  });
}

void Trainer::Restore(const CallSnapshot& snapshot) {
  at::NoGradGuard no_grad;
  adapter_->ZeroMainGrads();
  auto& params = adapter_->parameters();
  for (size_t i = 0; i < snapshot.main_grads.size(); ++i) params[i].main_grad.copy_(snapshot.main_grads[i]);
  dropout_generator_.set_state(snapshot.dropout_rng);
  pending_backward_calls_ = snapshot.pending_backward_calls;
}

absl::StatusOr<ForwardBackwardResult> Trainer::ForwardBackward(const std::vector<Datum>& datums,
                                                               const LossConfig& loss,
                                                               const BatchOptions& batch) {
  absl::Status valid = ValidateBatch(datums, loss, base_->config.vocab_size, options_.limits);
  if (options_.groups == nullptr) LORASTEP_RETURN_IF_ERROR(valid);
  // Keep what earlier calls accumulated so a failure mid-call can restore it exactly.
  LORASTEP_ASSIGN_OR_RETURN(CallSnapshot snapshot, Snapshot());
  absl::StatusOr<ForwardBackwardResult> result =
      valid.ok() ? GuardTorch([&] { return RunMicroBatches(datums, &loss, batch); })
                 : absl::StatusOr<ForwardBackwardResult>(valid);
  absl::Status agreed = AgreeOnOutcome(result.status());
  if (!agreed.ok()) {
    Restore(snapshot);
    return agreed;
  }
  ++pending_backward_calls_;
  return result;
}

absl::Status Trainer::AgreeOnOutcome(const absl::Status& local) {
  if (options_.groups == nullptr) return local;
  return GuardTorch([&]() -> absl::Status {
    at::Tensor ok = at::full({1}, local.ok() ? 1.0f : 0.0f,
                             at::TensorOptions().device(base_->device).dtype(at::kFloat));
    absl::Status vote = options_.groups->group(GroupKind::kWorld).AllReduce(ok, ReduceKind::kMin);
    if (!local.ok()) return local;
    if (!vote.ok()) return vote;
    if (ok.item<float>() < 1.0f) {
      return absl::AbortedError(absl::StrCat("rank ", options_.groups->rank(),
                                             ": another rank of the mesh failed this call; "
                                             "nothing was applied"));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<ForwardBackwardResult> Trainer::Forward(const std::vector<Datum>& datums) {
  LORASTEP_RETURN_IF_ERROR(ValidateForwardBatch(datums, base_->config.vocab_size, options_.limits));
  return GuardTorch([&] { return RunMicroBatches(datums, nullptr, BatchOptions{}); });
}

absl::StatusOr<OptimStepResult> Trainer::OptimStep(const AdamWParams& params) {
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(params));
  OptimStepResult result;
  auto t0 = Clock::now();
  LORASTEP_RETURN_IF_ERROR(FoldLocalGradients(adapter_.get()));
  // On a mesh the reduction rewrites main_grad: keep the local gradients so a step refused
  // after it (non-finite norm, a peer's failure) leaves them as they were.
  LORASTEP_ASSIGN_OR_RETURN(CallSnapshot snapshot,
                            options_.groups != nullptr ? Snapshot() : CallSnapshot{});
  auto norm = FinalizeStepGradients(adapter_.get(), options_.groups, options_.finalize);
  if (absl::Status agreed = AgreeOnOutcome(norm.status()); !agreed.ok()) norm = agreed;
  if (!norm.ok()) {
    if (options_.groups != nullptr) Restore(snapshot);
    return norm.status();
  }
  SyncDevice();
  result.metrics.Add("time_grad_finalize_s:sum", SecondsSince(t0));
  t0 = Clock::now();
  auto step = GuardTorch([&] { return optimizer_->Step(params, *norm); });
  if (!step.ok()) {
    if (options_.groups != nullptr) Restore(snapshot);
    return step.status();
  }
  SyncDevice();
  result.metrics.Add("time_optimizer_s:sum", SecondsSince(t0));
  result.metrics.Add("grad_norm:sum", step->grad_norm);
  result.metrics.Add("lr:sum", step->lr);
  pending_backward_calls_ = 0;
  result.learner_version = optimizer_->steps_taken();
  const bool mesh = options_.groups != nullptr && options_.groups->layout().world_size() > 1;
  if (mesh || !adapter_->full_finetune() || options_.digest_full_finetune_steps) {
    t0 = Clock::now();
    const std::string local_sha = AdapterSha256();
    result.replica_digests = ReplicaDigests(local_sha);
    // The reported adapter digest is of whole tensors, the same at every layout.
    const bool sliced = options_.groups != nullptr && base_->shard.tp > 1;
    result.adapter_sha256 = !sliced ? local_sha : adapter_->full_finetune() ? "" : FullAdapterSha256();
    result.metrics.Add("time_digest_s:sum", SecondsSince(t0));
  }
  return result;
}

std::map<std::string, std::string> Trainer::ReplicaDigests(const std::string& trainable_sha256) const {
  std::map<std::string, std::string> digests{{"trainable", trainable_sha256}};
  std::vector<at::Tensor> replicated;
  for (const Parameter& p : adapter_->parameters()) {
    if (p.role != kSplit) replicated.push_back(p.value);
  }
  if (!replicated.empty()) digests["tensor_replicated"] = TensorsSha256(replicated);
  return digests;
}

absl::StatusOr<OptimStepResult> Trainer::TrainStep(const std::vector<Datum>& datums,
                                                   const LossConfig& loss,
                                                   const AdamWParams& params,
                                                   const BatchOptions& batch) {
  // Validate the optimizer parameters too before any work: a bad call changes nothing.
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(params));
  auto t0 = Clock::now();
  LORASTEP_ASSIGN_OR_RETURN(CallSnapshot snapshot, Snapshot());
  LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult fb, ForwardBackward(datums, loss, batch));
  auto step = OptimStep(params);
  if (!step.ok()) {  // e.g. a non-finite gradient norm: undo this call entirely
    Restore(snapshot);
    return step.status();
  }
  step->metrics.Merge(fb.metrics);
  const double total = SecondsSince(t0);
  step->metrics.Add("time_step_s:sum", total);
  return step;
}

bool Trainer::WritesGatheredState() const {
  if (options_.groups == nullptr) return true;
  const RankCoords c = options_.groups->coords();
  return c.tp == 0 && c.pp == 0 && c.dp == 0;
}

absl::StatusOr<std::vector<at::Tensor>> Trainer::GatherTensorSplits(
    const std::vector<at::Tensor>& local) const {
  const auto& params = adapter_->parameters();
  if (options_.groups == nullptr || base_->shard.tp == 1) return local;
  CommGroup& tp = options_.groups->group(GroupKind::kTensor);
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].role != kSplit) {
      full.push_back(local[i]);
      continue;
    }
    // Slices may differ by one row (an uneven vocabulary split): pad to the largest,
    // gather, trim each to its own size, concatenate in tensor-rank order.
    const int dim = params[i].split_dim;
    at::Tensor size = at::full({1}, static_cast<double>(local[i].size(dim)),
                               local[i].options().dtype(at::kDouble));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> sizes, tp.AllGather(size));
    int64_t largest = 0;
    for (const auto& n : sizes) largest = std::max<int64_t>(largest, static_cast<int64_t>(n.item<double>()));
    at::Tensor padded = local[i];
    if (padded.size(dim) < largest) {
      std::vector<int64_t> pad_shape(padded.sizes().begin(), padded.sizes().end());
      pad_shape[dim] = largest - padded.size(dim);
      padded = at::cat({padded, at::zeros(pad_shape, padded.options())}, dim);
    }
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> parts, tp.AllGather(padded));
    for (size_t r = 0; r < parts.size(); ++r) {
      parts[r] = parts[r].narrow(dim, 0, static_cast<int64_t>(sizes[r].item<double>()));
    }
    full.push_back(at::cat(parts, dim));
  }
  return full;
}

absl::Status Trainer::ExportAdapter(const std::string& folder) const {
  return GuardTorch([&]() -> absl::Status {
    std::vector<at::Tensor> local;
    for (const Parameter& p : adapter_->parameters()) local.push_back(p.value);
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full, GatherTensorSplits(local));
    if (!WritesGatheredState()) return absl::OkStatus();
    return ExportPeftAdapter(folder, *adapter_, base_->path, &full);
  });
}

std::string Trainer::FullAdapterSha256() const {
  std::vector<at::Tensor> local;
  for (const Parameter& p : adapter_->parameters()) local.push_back(p.value);
  auto full = GatherTensorSplits(local);
  return full.ok() ? TensorsSha256(*full) : "";
}

absl::Status Trainer::SaveState(
    const std::string& folder,
    const std::function<absl::Status(const std::string&)>& fault_point) const {
  return GuardTorch([&]() -> absl::Status {
    // Layout-independent: tensor-parallel slices are gathered into whole tensors, so a
    // checkpoint saved on any mesh loads on any other (and at world size 1).
    std::vector<at::Tensor> values;
    for (const Parameter& p : adapter_->parameters()) values.push_back(p.value);
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_values, GatherTensorSplits(values));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_master, GatherTensorSplits(optimizer_->master()));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_avg, GatherTensorSplits(optimizer_->exp_avg()));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_avg_sq,
                              GatherTensorSplits(optimizer_->exp_avg_sq()));
    if (!WritesGatheredState()) return absl::OkStatus();
    auto write = [&](const std::string& tmp) -> absl::Status {
      TensorWriteList trainable, optimizer;
      const auto& params = adapter_->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        LORASTEP_RETURN_IF_ERROR(trainable.Add(params[i].name, full_values[i]));
        LORASTEP_RETURN_IF_ERROR(optimizer.Add(params[i].name + ".master", full_master[i]));
        LORASTEP_RETURN_IF_ERROR(optimizer.Add(params[i].name + ".exp_avg", full_avg[i]));
        LORASTEP_RETURN_IF_ERROR(optimizer.Add(params[i].name + ".exp_avg_sq", full_avg_sq[i]));
      }
      LORASTEP_RETURN_IF_ERROR(optimizer.Add("rng.dropout", dropout_generator_.get_state()));
      LORASTEP_RETURN_IF_ERROR(trainable.WriteTo(tmp + "/trainable.safetensors"));
      if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("trainable_written"));
      LORASTEP_RETURN_IF_ERROR(optimizer.WriteTo(tmp + "/optimizer.safetensors"));
      const LoraConfig& lora = adapter_->lora_config();
      nlohmann::ordered_json state;
      state["format_version"] = kStateFormatVersion;
      state["optimizer_steps"] = optimizer_->steps_taken();
      state["lora"] = {{"rank", lora.rank}, {"alpha", lora.alpha}, {"dropout", lora.dropout},
                       {"target_modules", lora.target_modules}};
      state["base_model"] = base_->path;
      state["parameter_count"] = params.size();
      return WriteStringToFile(tmp + "/trainer_state.json", state.dump(2) + "\n");
    };
    return WriteFolderAtomically(folder, write, fault_point);
  });
}

absl::Status Trainer::LoadState(const std::string& folder) {
  return GuardTorch([&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(std::string text, ReadFileToString(folder + "/trainer_state.json"));
    nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
    if (state.is_discarded() || state.value("format_version", 0) != kStateFormatVersion) {
      return absl::InvalidArgumentError(
          absl::StrCat(folder, "/trainer_state.json: unreadable or unknown format_version"));
    }
    const LoraConfig& lora = adapter_->lora_config();
    if (state["lora"]["rank"] != lora.rank || state["lora"]["alpha"] != lora.alpha ||
        state["lora"]["target_modules"] != lora.target_modules) {
      return absl::InvalidArgumentError(
          absl::StrCat(folder, ": lora config in the checkpoint differs from this run's"));
    }
    LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile trainable,
                              SafetensorsFile::Open(folder + "/trainable.safetensors"));
    LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile optimizer,
                              SafetensorsFile::Open(folder + "/optimizer.safetensors"));
    // Stage everything, checking names and shapes, before touching live state.
    // Checkpoints hold whole tensors; a tensor-parallel rank keeps its slice of each split one.
    const int tp = base_->shard.tp, tp_rank = base_->shard.tp_rank;
    auto stage = [&](const SafetensorsFile& file, const std::string& name,
                     const Parameter& param) -> absl::StatusOr<at::Tensor> {
      const at::Tensor& like = param.value;
      auto entry = file.Find(name);
      if (!entry.ok()) return absl::InvalidArgumentError(entry.status().message());
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor t, TensorFromEntry(**entry));
      if (tp > 1 && param.role == kSplit && t.dim() == like.dim() && t.dim() > param.split_dim) {
        const auto [begin, end] = EvenRange(t.size(param.split_dim), tp, tp_rank);
        t = t.narrow(param.split_dim, begin, end - begin);
      }
      if (!t.sizes().equals(like.sizes())) {
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": tensor '", name, "': shape mismatch"));
      }
      return t;
    };
    const auto& params = adapter_->parameters();
    std::vector<at::Tensor> values, master, avg, avg_sq;
    for (size_t i = 0; i < params.size(); ++i) {
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor v, stage(trainable, params[i].name, params[i]));
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor ms, stage(optimizer, params[i].name + ".master", params[i]));
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor a, stage(optimizer, params[i].name + ".exp_avg", params[i]));
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor s, stage(optimizer, params[i].name + ".exp_avg_sq", params[i]));
      values.push_back(v);
      master.push_back(ms);
      avg.push_back(a);
      avg_sq.push_back(s);
    }
    LORASTEP_ASSIGN_OR_RETURN(const SafetensorsEntry* rng, optimizer.Find("rng.dropout"));
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor rng_state, TensorFromEntry(*rng));
    LORASTEP_RETURN_IF_ERROR(AgreeOnOutcome(absl::OkStatus()));
    // Commit.
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      adapter_->parameters()[i].value.copy_(values[i]);
      optimizer_->master()[i].copy_(master[i]);
      optimizer_->exp_avg()[i].copy_(avg[i]);
      optimizer_->exp_avg_sq()[i].copy_(avg_sq[i]);
    }
    optimizer_->set_steps_taken(state["optimizer_steps"].get<int64_t>());
    dropout_generator_.set_state(rng_state);
    adapter_->ZeroMainGrads();
    pending_backward_calls_ = 0;
    return absl::OkStatus();
  });
}

}  // namespace lorastep
