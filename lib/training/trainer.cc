// The step pipeline: the micro-batch loop of ForwardBackward, Forward and TrainStep (each a
// mesh transaction: admission vote, micro-batches, outcome vote, staged commit), the call
// snapshot that undoes a failed call, and loading the base model. The activation planner,
// the votes and commit, and checkpoint I/O are in activation_plan.cc, trainer_commit.cc and
// trainer_state_io.cc.
#include "lib/training/trainer.h"
#include <ATen/core/grad_mode.h>

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "lib/device_peaks.h"
#include "lib/device_stats.h"
#include "lib/log.h"
#include "lib/io/checkpoint_dir.h"
#include "lib/io/digest.h"
#include "lib/io/file_util.h"
#include "lib/training/grad_finalizer.h"
#include "lib/model/logprobs.h"
#include "lib/training/losses.h"
#include "lib/model/peft_io.h"
#include "lib/model/qwen2.h"
#include "lib/parallel/context_parallel.h"
#include "lib/training/micro_batch.h"
#include "lib/training/stage_gather.h"
#include "lib/io/safetensors.h"
#include "lib/status_macros.h"
#include "lib/io/tensor_bytes.h"
#include "lib/torch_compat.h"
#include "lib/torch_status.h"
#include "nlohmann/json.hpp"

namespace lorastep {
namespace {

// MFU's denominator on a CUDA device: its dense bf16 peak (lib/device_peaks.h), looked up
// once per device; 0 where the device is unknown, said once in the log.
double DevicePeakFlops(const at::Device& device) {
  if (!device.is_cuda()) return 0;
  static std::mutex mu;
  static std::map<int, double> peaks;
  std::lock_guard<std::mutex> lock(mu);
  const int index = device.has_index() ? device.index() : 0;
  auto it = peaks.find(index);
  if (it != peaks.end()) return it->second;
  const std::string name = CudaDeviceName(device);
  const double peak = DenseBf16PeakFlops(name);
  if (peak == 0) {
    LORASTEP_LOG(Warning) << "MFU: no dense bf16 peak is known for CUDA device " << index << " ('" << name
                          << "'); mfu is reported as 0";
  }
  return peaks[index] = peak;
}

// moe_experts_hit:mean (share of a layer's experts that got tokens) and
// moe_load_max_over_mean:max (the busiest expert's tokens over the mean), one value per
// entry of `counts` (ForwardOptions::routing_counts).
void AddRoutingMetrics(const std::vector<at::Tensor>& counts, Metrics* metrics);
void AddRoutingMetrics(const std::vector<at::Tensor>& counts, Metrics* metrics) {
  if (counts.empty()) return;
  at::Tensor all = at::stack(counts).to(at::kCPU).to(at::kDouble);  // [layers x calls, E]
  for (int64_t row = 0; row < all.size(0); ++row) {
    at::Tensor c = all[row];
    const double mean = c.mean().item<double>();
    metrics->Add("moe_experts_hit:mean", (c > 0).to(at::kDouble).mean().item<double>(), 1.0);
    metrics->Add("moe_load_max_over_mean:max", mean > 0 ? c.max().item<double>() / mean : 0.0);
  }
}

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

absl::Status CancelledBeforeMicroBatch(size_t micro_batch, size_t micro_batches) {
  return absl::CancelledError(absl::StrCat(
      "call cancelled (its caller went away or its deadline passed) ",
      micro_batch < micro_batches ? absl::StrCat("before micro-batch ", micro_batch + 1, " of ", micro_batches)
                                  : "on another rank",
      "; nothing was applied"));
}

absl::Status CancelledInMicroBatch(size_t micro_batch, size_t micro_batches) {
  return absl::CancelledError(absl::StrCat("call cancelled (its caller went away or its deadline passed) during micro-batch ",
                                           micro_batch + 1, " of ", micro_batches, "; nothing was applied"));
}

double PeakHostMemoryBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

std::vector<std::vector<size_t>> Trainer::SplitMicroBatches(const std::vector<Datum>& datums,
                                                            int64_t max_tokens) const {
  return options_.pack_sequences ? PackIntoMicroBatches(datums, max_tokens)
                                 : SplitIntoMicroBatches(datums, max_tokens);
}

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
    PackProjections(&base->weights);
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
  // Positions past the model's table are refused up front (RoPE would extrapolate silently).
  options_.limits.max_positions = base_->config.max_position_embeddings;
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
    if (options.lora.full_finetune() && base->config.is_moe()) {
    return absl::UnimplementedError("lora.rank: full fine-tuning of a MoE model is not built yet");
  }
  if (options.lora.full_finetune()) {
      adapter = Adapter::CreateFullFinetune(base->weights, &base->shard,
                                            base->config.tie_word_embeddings, &base->config);
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
                                                               const BatchOptions& batch,
                                                               const std::vector<LayerRecompute>& recompute,
                                                               const std::vector<bool>& rule_kept_fits) {
  auto recomputes = [&](size_t i) { return i < recompute.size() ? recompute[i] : LayerRecompute::kNone; };
  // A replayed layer's rule keeps its intermediates for the replay's short life; otherwise
  // where the budget allows (rule_kept_fits).
  auto keeps_rule = [&](size_t i) {
    return recomputes(i) != LayerRecompute::kNone || (i < rule_kept_fits.size() && rule_kept_fits[i]);
  };
  const ModelConfig& config = base_->config;
  const bool backward = loss != nullptr;
  ForwardBackwardResult result;
  Metrics& m = result.metrics;
  ResetCudaPeakAllocated(base_->device);  // this call's peak (weights included)
  if (batch.return_logprobs) result.logprobs.resize(datums.size());

  const LossDenominators den = CallDenominators(datums, batch.totals, base_->device);

  // Forward uses the same micro-batches as ForwardBackward, though it keeps no activations:
  // other GEMM shapes round differently on CUDA, and a PPO step's on-policy ratio must be
  // exactly 1 (orchestrators check the first step's KL against zero; larger Forward
  // micro-batches are faster but move it off zero).
  const auto micro_batches = SplitMicroBatches(
      datums, batch.max_tokens_per_microbatch > 0 ? batch.max_tokens_per_microbatch
                                                  : options_.max_tokens_per_microbatch);
  ForwardOptions fwd_options{options_.grad, /*training=*/backward, &dropout_generator_};
  LoraGroupOperandCache lora_operands;  // the factors do not change within this call
  fwd_options.lora_operands = &lora_operands;
  std::vector<at::Tensor> routing_counts;
  fwd_options.routing_counts = &routing_counts;
  CommGroup* tensor_group = options_.groups != nullptr && base_->shard.tp > 1
                                ? &options_.groups->group(GroupKind::kTensor)
                                : nullptr;
  if (tensor_group != nullptr) {
    fwd_options.shard = &base_->shard;
    fwd_options.tensor_group = tensor_group;
  }
  CommGroup* expert_group = options_.groups != nullptr && base_->shard.ep > 1
                                ? &options_.groups->group(GroupKind::kExpert)
                                : nullptr;
  if (expert_group != nullptr) {
    fwd_options.shard = &base_->shard;
    fwd_options.expert_group = expert_group;
  }
  // Context parallelism: each micro-batch's packed row split over the context group, every
  // rank its load-balanced share of each sequence's tokens (the same datums on every rank).
  CommGroup* context_group = options_.groups != nullptr && options_.groups->layout().sizes().cp > 1
                                 ? &options_.groups->group(GroupKind::kContext)
                                 : nullptr;
  const VocabShard vocab{tensor_group, base_->shard.vocab_begin};
  double t_data = 0, t_forward = 0, t_backward = 0;
  double scored = 0;  // positions the head scored
  const double lora_params = LoraParameterCount(*adapter_);
  const double matmul_passes = !backward ? 1.0 : adapter_->full_finetune() ? 3.0 : 2.0;

  // Host-side inputs of every micro-batch, built before any compute.
  MicroBatchOptions mb_options;
  mb_options.pack_sequences = options_.pack_sequences;
  mb_options.backward = backward;
  mb_options.loss_positions_only = backward && !batch.return_logprobs;
  mb_options.context_group = context_group;
  mb_options.matmul_passes = matmul_passes;
  mb_options.lora_params = lora_params;
  mb_options.varlen_attention = compat::HasVarlenAttention(
      at::empty({0, 0, config.head_dim()}, at::TensorOptions().dtype(base_->dtype).device(base_->device)));
  MicroBatchCounts counts;
  std::vector<MicroBatch> mbs;
  const auto device = base_->device;
  {
    auto t0 = Clock::now();
    for (const auto& mb : micro_batches) {
      mbs.push_back(BuildMicroBatch(datums, mb, config, mb_options, device, &counts));
    }
    // Expert parallelism: every member of the expert group exchanges tokens in each
    // micro-batch's forward and backward, so all run as many micro-batches as the busiest;
    // the others add fillers (one padding token, no loss, zero gradient).
    if (expert_group != nullptr) {
      at::Tensor count = at::full({1}, static_cast<double>(mbs.size()), at::TensorOptions().dtype(at::kDouble).device(device));
      ThrowIfError(expert_group->AllReduce(count, ReduceKind::kMax));
      const size_t agreed = static_cast<size_t>(count.item<double>());
      while (mbs.size() < agreed) mbs.push_back(FillerMicroBatch(device));
    }
    t_data += SecondsSince(t0);
  }

  // The last stage's head: final norm, log-probs of the targets, the loss and its metrics.
  // Returns the micro-batch's (already normalized) loss, undefined for a forward-only call.
  // Per-micro-batch results stay on the device until every micro-batch has run: one host
  // synchronization for all log-probs and one for all metrics, not a dozen per micro-batch.
  PendingMetrics pending;
  std::vector<std::pair<const MicroBatch*, at::Tensor>> pending_logprobs;
  auto head = [&](const MicroBatch& mb, const at::Tensor& layers_out) -> at::Tensor {
    // A filler's backward must still run every layer's exchanges: a zero loss on its output.
    if (mb.filler) return backward ? layers_out.sum() * 0.0 : at::Tensor();
    at::Tensor hidden = Qwen2FinalNorm(config, base_->weights, adapter_.get(), layers_out);
    at::Tensor selected = FoldLeadingDims(hidden).index_select(0, mb.positions);
    scored += static_cast<double>(mb.positions.size(0));
    TokenScores scores =
        Qwen2HeadScores(base_->weights, adapter_.get(), selected, mb.targets, options_.logprob_chunk_tokens,
                        fwd_options, vocab, /*entropy_grad=*/backward && loss->entropy_coef != 0);
    if (batch.return_logprobs) pending_logprobs.emplace_back(&mb, scores.logprobs.detach());
    if (!backward) {
      at::Tensor bearing = (mb.loss_in.mask != 0).to(at::kDouble);
      pending.Add("entropy:mean", (scores.entropy.detach().to(at::kDouble) * bearing).sum(), bearing.sum());
      return at::Tensor();
    }
    LossInputs in = mb.loss_in;
    in.logprobs = scores.logprobs;
    in.entropy = scores.entropy;
    return ComputeLoss(*loss, in, den, &pending);
  };

  c10::optional<at::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();
  // On a mesh the ranks ask together, as often as the rank with the most micro-batches does.
  size_t cancel_rounds = mbs.size();
  if (batch.cancelled && batch.agree_on_cancel && options_.groups != nullptr) {
    at::Tensor most = at::full({1}, static_cast<double>(mbs.size()), at::TensorOptions().dtype(at::kDouble).device(device));
    LORASTEP_RETURN_IF_ERROR(options_.groups->group(GroupKind::kWorld).AllReduce(most, ReduceKind::kMax));
    cancel_rounds = static_cast<size_t>(most.item<double>());
  }
  auto stop_before = [&](size_t i) -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(const bool stop, CallCancelled(batch));
    if (!stop) return absl::OkStatus();
    return CancelledBeforeMicroBatch(i, mbs.size());
  };
  if (base_->shard.pp == 1) {
    // No host synchronization between micro-batches: the phases are timed by marks in the
    // device's queue, read once after the last micro-batch.
    std::vector<DeviceMark> marks{DeviceMark::Now(device)};
    // One process: a cancelled call also stops between the layers of a micro-batch, in
    // forward and in backward (a mesh's ranks stop together, between micro-batches).
    fwd_options.cancelled = options_.groups == nullptr && batch.cancelled ? &batch.cancelled : nullptr;
    for (size_t i = 0; i < mbs.size(); ++i) {
      const MicroBatch& mb = mbs[i];
      LORASTEP_RETURN_IF_ERROR(stop_before(i));
      fwd_options.packed = mb.is_packed ? &mb.packed : nullptr;
      fwd_options.recompute_layers = recomputes(i);
      fwd_options.keep_linear_attention_rule = keeps_rule(i);
      try {
        at::Tensor x = Qwen2Embed(config, base_->weights, adapter_.get(), mb.tokens, fwd_options);
        x = Qwen2Layers(config, base_->weights, adapter_.get(), x, fwd_options);
        at::Tensor loss_value = head(mb, x);
        marks.push_back(DeviceMark::Now(device));
        if (backward) {
          loss_value.backward();
          marks.push_back(DeviceMark::Now(device));
        }
      } catch (const std::exception&) {
        // LayersCancelled, possibly rethrown by autograd as another type: the token says.
        if (fwd_options.cancelled == nullptr || !batch.cancelled()) throw;
        return CancelledInMicroBatch(i, mbs.size());
      }
    }
    const size_t per_mb = backward ? 2 : 1;
    for (size_t k = 1; k < marks.size(); ++k) {
      const double seconds = marks[k].SecondsSince(marks[k - 1]);
      ((k - 1) % per_mb == 0 ? t_forward : t_backward) += seconds;
    }
  } else {
    LORASTEP_RETURN_IF_ERROR(RunPipelineSchedule(
        static_cast<int>(mbs.size()), backward,
        [&](int i) { return std::vector<int64_t>{mbs[i].b, mbs[i].longest, config.hidden_size}; },
        [&](int i, const at::Tensor& x_in) -> at::Tensor {  // this stage's forward
          fwd_options.packed = mbs[i].is_packed ? &mbs[i].packed : nullptr;
          fwd_options.recompute_layers = recomputes(static_cast<size_t>(i));
          fwd_options.keep_linear_attention_rule = keeps_rule(static_cast<size_t>(i));
          at::Tensor x = base_->shard.first_stage()
                             ? Qwen2Embed(config, base_->weights, adapter_.get(), mbs[i].tokens, fwd_options)
                             : x_in;
          x = Qwen2Layers(config, base_->weights, adapter_.get(), x, fwd_options);
          return base_->shard.last_stage() ? head(mbs[i], x) : x;
        },
        [&](int i) { return stop_before(static_cast<size_t>(i)); }, &t_forward, &t_backward));
  }
  for (size_t i = mbs.size(); i < cancel_rounds; ++i) LORASTEP_RETURN_IF_ERROR(stop_before(i));
  if (!pending_logprobs.empty()) {
    std::vector<at::Tensor> parts;
    for (const auto& [mb, lp] : pending_logprobs) {  // with cp: the whole row from every rank's share
      parts.push_back(context_group != nullptr ? GatherContextShares(lp, context_group, mb->context) : lp);
    }
    const at::Tensor all = at::cat(parts).to(at::kCPU);
    const float* lp = all.data_ptr<float>();
    for (const auto& [mb, unused] : pending_logprobs) {
      for (size_t d : *mb->datums) {
        result.logprobs[d].assign(lp, lp + datums[d].tokens.size());
        lp += datums[d].tokens.size();
      }
    }
  }
  pending.Resolve(&m);
  Metrics routing;  // one host synchronization for every MoE layer of every micro-batch
  AddRoutingMetrics(routing_counts, &routing);
  m.Merge(routing);
  if (!base_->shard.last_stage()) {  // only the last stage sees the loss: no data metrics here
    m = routing;
    m.Add("time_data_s:sum", t_data);
    m.Add("time_forward_s:sum", t_forward);
    if (backward) m.Add("time_backward_s:sum", t_backward);
    m.Set("peak_host_memory_bytes:max", PeakHostMemoryBytes());
    AddCudaPeakMemory(&m);
    return result;
  }
  m.Add("tokens_physical:sum", counts.physical);
  m.Add("tokens_nonpadding:sum", counts.real_tokens);
  m.Add("tokens_scored:sum", scored);
  // Counted once per replica: on its first context rank.
  const bool counts_batch = context_group == nullptr || context_group->rank() == 0;
  m.Add("tokens_loss:sum", counts_batch ? den.loss_tokens : 0.0);
  m.Add("micro_batches:sum", counts_batch ? static_cast<double>(micro_batches.size()) : 0.0);
  if (backward) {
    double recomputed = 0, selective = 0;
    for (size_t i = 0; i < micro_batches.size(); ++i) {
      recomputed += recomputes(i) != LayerRecompute::kNone ? 1 : 0;
      selective += recomputes(i) == LayerRecompute::kSelective ? 1 : 0;
    }
    m.Add("micro_batches_recomputed:sum", counts_batch ? recomputed : 0.0);
    m.Add("micro_batches_recomputed_selective:sum", counts_batch ? selective : 0.0);
    if (config.HasLinearAttention()) {
      double rule_rerun = 0;
      for (size_t i = 0; i < micro_batches.size(); ++i) rule_rerun += keeps_rule(i) ? 0 : 1;
      m.Add("micro_batches_rule_recomputed:sum", counts_batch ? rule_rerun : 0.0);
    }
  }
  m.Add("time_data_s:sum", t_data);
  m.Add("time_forward_s:sum", t_forward);
  if (backward) m.Add("time_backward_s:sum", t_backward);
  const double compute_s = t_forward + t_backward;
  m.Add("model_flops:sum", counts.flops);
  if (compute_s > 0) m.Add("tokens_per_s:sum", counts.real_tokens / compute_s);
  const double peak = options_.peak_flops > 0 ? options_.peak_flops : DevicePeakFlops(base_->device);
  if (compute_s > 0 && (peak > 0 || base_->device.is_cuda())) {
    m.Add("mfu:sum", peak > 0 ? counts.flops / compute_s / peak : 0.0);
  }
  m.Set("peak_host_memory_bytes:max", PeakHostMemoryBytes());
  AddCudaPeakMemory(&m);
  return result;
}

void Trainer::AddCudaPeakMemory(Metrics* metrics) const {
  const int64_t peak = CudaPeakAllocatedBytes(base_->device);
  if (peak >= 0) metrics->Set("peak_cuda_memory_bytes:max", static_cast<double>(peak));
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
  return AdmittedForwardBackward(datums, loss, batch, absl::OkStatus());
}

absl::StatusOr<ForwardBackwardResult> Trainer::AdmittedForwardBackward(const std::vector<Datum>& datums,
                                                                       const LossConfig& loss,
                                                                       const BatchOptions& batch,
                                                                       const absl::Status& caller_checks) {
  absl::Status local = caller_checks;
  if (local.ok()) local = ValidateBatch(datums, loss, base_->config.vocab_size, options_.limits);
  std::vector<LayerRecompute> recompute;
  std::vector<bool> rule_kept_fits;
  if (local.ok()) local = CheckActivationBudget(datums, batch, /*backward=*/true, &recompute, &rule_kept_fits);
  // Keep what earlier calls accumulated so a failure mid-call can restore it exactly.
  absl::StatusOr<CallSnapshot> snapshot = local.ok() ? Snapshot() : absl::StatusOr<CallSnapshot>(local);
  // Admission: every rank's own checks are done; the world votes before any collective of the
  // call, so a rank that refuses never leaves its peers inside one.
  LORASTEP_RETURN_IF_ERROR(AgreeOnOutcome(snapshot.status()));
  if (absl::Status agreed = AgreeOnRecompute(&recompute); !agreed.ok()) {
    Restore(*snapshot);
    return agreed;
  }
  absl::StatusOr<ForwardBackwardResult> result =
      GuardTorch([&] { return RunMicroBatches(datums, &loss, batch, recompute, rule_kept_fits); });
  absl::Status agreed = AgreeOnOutcome(result.status());
  if (!agreed.ok()) {
    Restore(*snapshot);
    return agreed;
  }
  ++pending_backward_calls_;
  return result;
}

absl::StatusOr<ForwardBackwardResult> Trainer::Forward(const std::vector<Datum>& datums, const BatchOptions& batch) {
  absl::Status local = ValidateForwardBatch(datums, base_->config.vocab_size, options_.limits);
  if (local.ok()) local = CheckActivationBudget(datums, BatchOptions{}, /*backward=*/false);
  LORASTEP_RETURN_IF_ERROR(AgreeOnOutcome(local));  // admission, as in ForwardBackward
  BatchOptions forward_only;
  forward_only.cancelled = batch.cancelled;
  forward_only.agree_on_cancel = batch.agree_on_cancel;
  absl::StatusOr<ForwardBackwardResult> result =
      GuardTorch([&] { return RunMicroBatches(datums, nullptr, forward_only); });
  LORASTEP_RETURN_IF_ERROR(AgreeOnOutcome(result.status()));
  return result;
}

absl::StatusOr<OptimStepResult> Trainer::TrainStep(const std::vector<Datum>& datums,
                                                   const LossConfig& loss,
                                                   const AdamWParams& params,
                                                   const BatchOptions& batch) {
  // The optimizer parameters are checked with the batch, before any work: a bad call changes
  // nothing, and on a mesh every rank learns of any rank's refusal at admission.
  absl::Status local = ValidateAdamWParams(params);
  const bool profile = !options_.profile_trace_path.empty() && ++train_steps_run_ == options_.profile_train_step;
  if (profile && local.ok()) {
    SyncDevice();
    local = StartKernelProfile();
  }
  auto t0 = Clock::now();
  absl::StatusOr<CallSnapshot> taken = local.ok() ? Snapshot() : absl::StatusOr<CallSnapshot>(local);
  BatchOptions scored_for_loss = batch;  // a step returns no log-probs
  scored_for_loss.return_logprobs = false;
  LORASTEP_ASSIGN_OR_RETURN(ForwardBackwardResult fb,
                            AdmittedForwardBackward(datums, loss, scored_for_loss, taken.status()));
  const CallSnapshot snapshot = *std::move(taken);
  // The snapshot above covers a failed step: no second copy of the gradients.
  auto step = StepOptimizer(params, /*restore_on_failure=*/false);
  if (!step.ok()) {  // e.g. a non-finite gradient norm: undo this call entirely
    Restore(snapshot);
    return step.status();
  }
  step->metrics.Merge(fb.metrics);
  AddCudaPeakMemory(&step->metrics);  // forward, backward and the optimizer
  const double total = SecondsSince(t0);
  step->metrics.Add("time_step_s:sum", total);
  if (profile) {
    SyncDevice();
    LORASTEP_RETURN_IF_ERROR(StopKernelProfile(options_.profile_trace_path));
  }
  return step;
}

}  // namespace lorastep
