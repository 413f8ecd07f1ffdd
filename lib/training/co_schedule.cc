// Trainer::JointTrainStep: several runs' TrainSteps on one base model as one forward/backward
// per micro-batch (co-scheduling, issue 30). The runs' packed micro-batches are laid side by
// side in one row; the decoder runs once over it with each run's LoRA on its own rows
// (ForwardOptions::run_segments); each run's head, loss and denominators are its own, and
// the backward of the sum of the runs' losses leaves in each adapter exactly its own
// gradient (every op but attention is row-wise, and attention stays within a sequence).
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "lib/device_stats.h"
#include "lib/env_switch.h"
#include "lib/io/digest.h"
#include "lib/log.h"
#include "lib/model/logprobs.h"
#include "lib/model/qwen2.h"
#include "lib/status_macros.h"
#include "lib/torch_status.h"
#include "lib/training/activation_memory.h"
#include "lib/training/adamw.h"
#include "lib/training/grad_finalizer.h"
#include "lib/training/losses.h"
#include "lib/training/micro_batch.h"
#include "lib/training/trainer.h"

namespace lorastep {
namespace {

// Whether PackJointRows evens out its rows (LORASTEP_JOINT_ROWS_EVEN=0 keeps the rows packed
// up to the budget, for A/B measurements).
bool EvenJointRows() {
  static const bool enabled = EnvSwitchOn("LORASTEP_JOINT_ROWS_EVEN");
  return enabled;
}

// Packed micro-batches of several runs as one row, in order; each run's segment of it.
struct JointRow {
  at::Tensor tokens;  // [1, total]
  PackedSequences packed;
  std::vector<int64_t> begins;  // where each part starts in the row
};

JointRow JoinPackedRows(const std::vector<const MicroBatch*>& parts) {
  JointRow row;
  std::vector<at::Tensor> tokens, positions, cu_parts{at::zeros({1}, at::kInt)};
  int64_t offset = 0;
  for (const MicroBatch* mb : parts) {
    row.begins.push_back(offset);
    tokens.push_back(mb->tokens);
    positions.push_back(mb->packed.positions);
    cu_parts.push_back(mb->packed.cu_seqlens.to(at::kCPU).narrow(0, 1, mb->packed.lengths.size()) +
                       static_cast<int32_t>(offset));
    row.packed.lengths.insert(row.packed.lengths.end(), mb->packed.lengths.begin(), mb->packed.lengths.end());
    row.packed.max_length = std::max(row.packed.max_length, mb->packed.max_length);
    offset += mb->tokens.size(1);
  }
  row.tokens = at::cat(tokens, 1);
  row.packed.positions = at::cat(positions);
  row.packed.cu_seqlens = at::cat(cu_parts).to(at::kInt).to(parts.front()->packed.cu_seqlens.device());
  return row;
}

// The decoder over a joint row, each segment's run with its own LoRA (and dropout stream
// while training).
at::Tensor JointLayers(const BaseModel& base, const JointRow& row, const std::vector<RunSegment>& segments,
                       bool training) {
  ForwardOptions joint;
  joint.training = training;
  joint.packed = &row.packed;
  joint.run_segments = &segments;
  const at::Tensor x = Qwen2Embed(base.config, base.weights, nullptr, row.tokens, joint);
  return Qwen2Layers(base.config, base.weights, nullptr, x, joint);
}

// Each datum's log-probs from a run's micro-batches (datum order and log-probs on the
// device, one entry per micro-batch in order): one copy to the host.
std::vector<std::vector<float>> GatherLogprobs(const std::vector<Datum>& datums,
                                               const std::vector<std::pair<std::vector<size_t>, at::Tensor>>& parts) {
  std::vector<std::vector<float>> out(datums.size());
  if (parts.empty()) return out;
  std::vector<at::Tensor> values;
  for (const auto& [unused, lp] : parts) values.push_back(lp);
  const at::Tensor all = at::cat(values).to(at::kFloat).to(at::kCPU).contiguous();
  const float* lp = all.data_ptr<float>();
  for (const auto& [order, unused] : parts) {
    for (size_t d : order) {
      out[d].assign(lp, lp + datums[d].tokens.size());
      lp += datums[d].tokens.size();
    }
  }
  return out;
}

// One result per call: the refused calls' refusals, the others "not run" until filled in.
template <typename Result>
std::vector<absl::StatusOr<Result>> WithRefusals(const std::vector<absl::Status>& refused) {
  std::vector<absl::StatusOr<Result>> results(refused.size(), absl::UnknownError("not run"));
  for (size_t c = 0; c < refused.size(); ++c) {
    if (!refused[c].ok()) results[c] = refused[c];
  }
  return results;
}

}  // namespace

absl::Status Trainer::JoinStep(const Trainer* trainer, const std::vector<Datum>* datums, const BaseModel** base,
                              std::set<const Trainer*>* seen) {
  auto refuse = [](const std::string& why) { return absl::InvalidArgumentError("co-scheduling: " + why); };
  if (trainer == nullptr || datums == nullptr) return refuse("a call needs its trainer and datums");
  if (!seen->insert(trainer).second) return refuse("a run takes part once per step");
  if (*base == nullptr) *base = trainer->base_.get();
  if (trainer->base_.get() != *base) return refuse("every run of a step shares one base model");
  if (!trainer->CoSchedulable()) return refuse("world size 1, LoRA on a dense model and packed sequences only");
  return absl::OkStatus();
}

std::vector<std::vector<Trainer::JointPart>> Trainer::PackJointRows(
    const std::vector<Trainer*>& trainers, const std::vector<const std::vector<Datum>*>& datums,
    const std::vector<std::vector<std::vector<size_t>>>& splits, bool backward) {
  const BaseModel& base = *trainers.front()->base_;
  const int64_t budget = trainers.front()->ActivationBudgetBytes();
  bool mlp_kept = false;
  int64_t chunk = 0;
  size_t steps = 0;
  for (size_t r = 0; r < trainers.size(); ++r) {
    mlp_kept = mlp_kept || (backward && trainers[r]->MlpActivationKept());
    chunk = std::max(chunk, trainers[r]->options_.logprob_chunk_tokens);
    steps = std::max(steps, splits[r].size());
  }
  const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(base.dtype));
  auto part_tokens = [&](size_t r, size_t k) {
    int64_t n = 0;
    for (size_t d : splits[r][k]) n += static_cast<int64_t>((*datums[r])[d].tokens.size());
    return n;
  };
  // In order, a new row where the next part would not fit the budget or `cap` tokens (0: no cap).
  auto pack = [&](int64_t cap) {
    std::vector<std::vector<JointPart>> rows;
    std::vector<int64_t> lengths;  // the current row's sequences
    int64_t row_tokens = 0;
    for (size_t k = 0; k < steps; ++k) {
      for (size_t r = 0; r < trainers.size(); ++r) {
        if (k >= splits[r].size()) continue;
        std::vector<int64_t> with = lengths;
        for (size_t d : splits[r][k]) with.push_back(static_cast<int64_t>((*datums[r])[d].tokens.size()));
        const int64_t tokens = part_tokens(r, k);
        // A run appears once per row: its micro-batches run one after another, as alone (its
        // dropout stream draws in the same order).
        const bool run_in_row = !rows.empty() && std::any_of(rows.back().begin(), rows.back().end(),
                                                             [&](const JointPart& p) { return p.first == r; });
        if (rows.empty() || run_in_row || (cap > 0 && row_tokens + tokens > cap) ||
            (budget >= 0 && EstimatePackedActivationBytes(base.config, base.shard, with, backward, element_bytes, chunk,
                                                          LayerRecompute::kNone, mlp_kept) > static_cast<double>(budget))) {
          rows.emplace_back();
          with.erase(with.begin(), with.begin() + static_cast<std::ptrdiff_t>(lengths.size()));
          row_tokens = 0;
        }
        rows.back().push_back({r, k});
        row_tokens += tokens;
        lengths = std::move(with);
      }
    }
    return rows;
  };
  std::vector<std::vector<JointPart>> rows = pack(0);
  if (rows.size() < 2 || !EvenJointRows()) return rows;
  // As many rows, of even length where the parts allow: packing up to the budget leaves a
  // short last row (the 7B benchmark's eight 4,096-token calls as 6 + 2), while rows of one
  // length run the same GEMM shapes and hold less activation memory at the step's peak.
  int64_t total = 0;
  for (const auto& row : rows) {
    for (const auto& [r, k] : row) total += part_tokens(r, k);
  }
  const auto count = static_cast<int64_t>(rows.size());
  std::vector<std::vector<JointPart>> even = pack((total + count - 1) / count);
  return even.size() == rows.size() ? even : rows;
}

namespace {

// What a run's head needs in a joint row: its adapter (a head LoRA), gradient options,
// logit chunk, dropout stream (training) and whether its loss needs the entropy's gradient.
struct RunHead {
  const Adapter* adapter;
  GradOptions grad;
  int64_t chunk_tokens;
  at::Generator* dropout;  // null outside training
  bool entropy_grad;
};

// One run's head over its part of a joint row: its own final norm, positions and LM head
// (with its head LoRA, if any).
TokenScores RunHeadScores(const BaseModel& base, const RunHead& run, const at::Tensor& x, const RunSegment& segment,
                          const MicroBatch& mb) {
  const ForwardOptions own{run.grad, /*training=*/run.dropout != nullptr, run.dropout};
  const at::Tensor hidden = Qwen2FinalNorm(base.config, base.weights, run.adapter,
                                           x.narrow(1, segment.begin, segment.end - segment.begin));
  return Qwen2HeadScores(base.weights, run.adapter, FoldLeadingDims(hidden).index_select(0, mb.positions), mb.targets,
                         run.chunk_tokens, own, VocabShard{}, run.entropy_grad);
}

// The heads of every run of a joint row as one: where no run has a head LoRA (the final norm
// and the LM head are then the base's for all) and the runs' gradient options agree, one
// final norm over the row and one chunked head over every run's scored positions, split back
// per run (each token's scores depend on its own row only). Empty where the runs differ.
std::vector<TokenScores> SharedHeadScores(const BaseModel& base, const std::vector<RunHead>& runs, const at::Tensor& x,
                                          const std::vector<RunSegment>& segments, const std::vector<MicroBatch>& mbs) {
  if (runs.size() < 2) return {};
  const GradOptions& grad = runs.front().grad;
  int64_t chunk = 0;
  bool entropy_grad = false;
  for (const RunHead& run : runs) {
    if (run.adapter == nullptr || run.adapter->head_lora() != nullptr || run.adapter->full_finetune() ||
        run.grad.fused_wgrad != grad.fused_wgrad || run.grad.fp32_dgrad != grad.fp32_dgrad) {
      return {};
    }
    chunk = std::max(chunk, run.chunk_tokens);
    entropy_grad = entropy_grad || run.entropy_grad;
  }
  std::vector<at::Tensor> positions, targets;
  std::vector<int64_t> counts;
  for (size_t j = 0; j < mbs.size(); ++j) {
    positions.push_back(mbs[j].positions + segments[j].begin);
    targets.push_back(mbs[j].targets);
    counts.push_back(mbs[j].positions.size(0));
  }
  const at::Tensor hidden = Qwen2FinalNorm(base.config, base.weights, nullptr, x);
  const at::Tensor selected = FoldLeadingDims(hidden).index_select(0, at::cat(positions));
  const ForwardOptions options{grad, /*training=*/false, nullptr};  // no head LoRA: nothing drops out
  const TokenScores all =
      Qwen2HeadScores(base.weights, nullptr, selected, at::cat(targets), chunk, options, VocabShard{}, entropy_grad);
  const std::vector<at::Tensor> logprobs = all.logprobs.split_with_sizes(counts);
  const std::vector<at::Tensor> entropy = all.entropy.split_with_sizes(counts);
  std::vector<TokenScores> out;
  for (size_t j = 0; j < counts.size(); ++j) out.push_back({logprobs[j], entropy[j]});
  return out;
}

}  // namespace

// The shared part of the joint calls: admission, then every joint row's forward (and, for
// the training kinds, backward), each run's gradients accumulating in its own main_grads.
struct Trainer::JointPass {
  std::vector<absl::Status> refused;  // per call: OK when admitted (or run alone)
  std::vector<size_t> admitted, alone;
  std::vector<CallSnapshot> snapshots;  // per call (training kinds)
  std::vector<std::vector<std::vector<size_t>>> splits;  // per admitted run
  std::vector<LossDenominators> dens;
  std::vector<PendingMetrics> pending;
  std::vector<MicroBatchCounts> counts;
  std::vector<double> scored;  // positions the head scored (kForward)
  std::vector<std::optional<size_t>> cancelled_before;  // the micro-batch a cancelled run stopped at
  // Each run's log-probs per micro-batch (datum order, on the device), when returned.
  std::vector<std::vector<std::pair<std::vector<size_t>, at::Tensor>>> logprobs;
  size_t rows = 0;
  int64_t longest_row = 0;  // the longest joint row's tokens
  double seconds = 0, joint_tokens = 0;
  absl::Status ran;
};

Trainer::JointPass Trainer::RunJointPass(const std::vector<JointTrainCall>& calls, JointKind kind) {
  const bool backward = kind != JointKind::kForward, optimizer_step = kind == JointKind::kTrainStep;
  JointPass pass;
  pass.refused.assign(calls.size(), absl::OkStatus());
  pass.snapshots.resize(calls.size());
  // Admission: each call on its own; a refused call leaves the step, alone.
  const BaseModel* base = nullptr;
  std::set<const Trainer*> seen;
  for (size_t c = 0; c < calls.size(); ++c) {
    const JointTrainCall& call = calls[c];
    if (backward && call.loss == nullptr) {
      pass.refused[c] = absl::InvalidArgumentError("co-scheduling: a training call needs its loss");
      continue;
    }
    if (absl::Status member = JoinStep(call.trainer, call.datums, &base, &seen); !member.ok()) {
      pass.refused[c] = member;
      continue;
    }
    Trainer& t = *call.trainer;
    if (!backward) {
      absl::Status local = ValidateForwardBatch(*call.datums, t.base_->config.vocab_size, t.options_.limits);
      if (local.ok()) local = t.CheckActivationBudget(*call.datums, BatchOptions{}, /*backward=*/false);
      if (local.ok()) pass.admitted.push_back(c);
      pass.refused[c] = local;
      continue;
    }
    absl::Status local = optimizer_step ? ValidateAdamWParams(call.adamw) : absl::OkStatus();
    if (local.ok()) local = ValidateBatch(*call.datums, *call.loss, t.base_->config.vocab_size, t.options_.limits);
    BatchOptions batch;
    batch.max_tokens_per_microbatch = call.max_tokens_per_microbatch;
    batch.totals = call.totals;
    std::vector<LayerRecompute> recompute;
    if (local.ok()) local = t.CheckActivationBudget(*call.datums, batch, /*backward=*/true, &recompute);
    if (local.ok() && std::any_of(recompute.begin(), recompute.end(),
                                  [](LayerRecompute r) { return r != LayerRecompute::kNone; })) {
      pass.alone.push_back(c);  // recomputation replays layers the joint row does not keep: on its own
      continue;
    }
    absl::StatusOr<CallSnapshot> snapshot = local.ok() ? t.Snapshot() : absl::StatusOr<CallSnapshot>(local);
    if (!snapshot.ok()) {
      pass.refused[c] = snapshot.status();
      continue;
    }
    pass.snapshots[c] = *std::move(snapshot);
    pass.admitted.push_back(c);
  }
  if (pass.admitted.empty()) return pass;

  // Each run's micro-batches as it would split them alone.
  const ModelConfig& config = base->config;
  const auto device = base->device;
  const size_t n = pass.admitted.size();
  pass.splits.resize(n);
  pass.dens.resize(n);
  pass.pending.resize(n);
  pass.counts.resize(n);
  pass.scored.assign(n, 0.0);
  pass.cancelled_before.resize(n);
  pass.logprobs.resize(n);
  std::vector<double> lora_params(n);
  std::vector<Trainer*> trainers;
  std::vector<const std::vector<Datum>*> batches;
  for (size_t r = 0; r < n; ++r) {
    const JointTrainCall& call = calls[pass.admitted[r]];
    Trainer& t = *call.trainer;
    pass.splits[r] = t.SplitMicroBatches(*call.datums, call.max_tokens_per_microbatch > 0
                                                           ? call.max_tokens_per_microbatch
                                                           : t.options_.max_tokens_per_microbatch);
    if (backward) pass.dens[r] = CallDenominators(*call.datums, call.totals, device);
    lora_params[r] = LoraParameterCount(*t.adapter_);
    trainers.push_back(&t);
    batches.push_back(call.datums);
  }
  const std::vector<std::vector<JointPart>> rows = PackJointRows(trainers, batches, pass.splits, backward);
  pass.rows = rows.size();
  pass.ran = GuardTorch([&]() -> absl::Status {
    std::optional<at::NoGradGuard> no_grad;
    if (!backward) no_grad.emplace();
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::vector<JointPart>& row_parts : rows) {
      std::vector<size_t> runs;  // positions in `admitted`, one per part
      std::vector<MicroBatch> mbs;
      for (const auto& [r, k] : row_parts) {
        const JointTrainCall& call = calls[pass.admitted[r]];
        if (!pass.cancelled_before[r] && call.cancelled && call.cancelled()) pass.cancelled_before[r] = k;
        if (pass.cancelled_before[r]) continue;  // its later parts leave the rows
        MicroBatchOptions options;  // as the run's own call alone
        options.always_pack = true;
        if (backward) {
          options.backward = true;
          options.loss_positions_only = optimizer_step;  // ForwardBackward returns every log-prob
          options.matmul_passes = 2;
          options.lora_params = lora_params[r];
        }
        runs.push_back(r);
        mbs.push_back(BuildMicroBatch(*call.datums, pass.splits[r][k], config, options, device, &pass.counts[r]));
      }
      if (mbs.empty()) continue;  // every part's run was cancelled
      std::vector<const MicroBatch*> parts;
      for (const MicroBatch& mb : mbs) parts.push_back(&mb);
      const JointRow row = JoinPackedRows(parts);
      pass.longest_row = std::max(pass.longest_row, row.tokens.size(1));
      std::vector<RunSegment> segments;
      for (size_t j = 0; j < runs.size(); ++j) {
        Trainer& t = *trainers[runs[j]];
        segments.push_back({t.adapter_.get(), row.begins[j], row.begins[j] + mbs[j].tokens.size(1),
                            backward ? &t.dropout_generator_ : nullptr});
      }
      const at::Tensor x = JointLayers(*base, row, segments, /*training=*/backward);
      std::vector<RunHead> heads;
      for (size_t r : runs) {
        const JointTrainCall& call = calls[pass.admitted[r]];
        Trainer& t = *call.trainer;
        heads.push_back({t.adapter_.get(), t.options_.grad, t.options_.logprob_chunk_tokens,
                         backward ? &t.dropout_generator_ : nullptr, backward && call.loss->entropy_coef != 0});
      }
      const std::vector<TokenScores> shared = SharedHeadScores(*base, heads, x, segments, mbs);
      // Runs under the same loss (options and kinds of inputs alike) compute it as one
      // (ComputeJointLoss: one set of kernels for all of them, each run normalized by its own
      // denominators, its metrics its own); a run with a loss of its own, on its own.
      struct LossGroup {
        const LossConfig* config;
        std::vector<LossInputs> ins;
        std::vector<const LossDenominators*> dens;
        std::vector<PendingMetrics*> metrics;
      };
      std::vector<LossGroup> groups;
      for (size_t j = 0; j < runs.size(); ++j) {
        const size_t r = runs[j];
        const JointTrainCall& call = calls[pass.admitted[r]];
        pass.scored[r] += static_cast<double>(mbs[j].positions.size(0));
        const TokenScores scores = shared.empty() ? RunHeadScores(*base, heads[j], x, segments[j], mbs[j]) : shared[j];
        if (!optimizer_step) pass.logprobs[r].emplace_back(*mbs[j].datums, scores.logprobs.detach());
        if (!backward) {
          const at::Tensor bearing = (mbs[j].loss_in.mask != 0).to(at::kDouble);
          pass.pending[r].Add("entropy:mean", (scores.entropy.to(at::kDouble) * bearing).sum(), bearing.sum());
          continue;
        }
        LossInputs in = mbs[j].loss_in;
        in.logprobs = scores.logprobs;
        in.entropy = scores.entropy;
        auto group = std::find_if(groups.begin(), groups.end(), [&](const LossGroup& g) {
          return *g.config == *call.loss && SameLossInputsDefined(g.ins.front(), in);
        });
        if (group == groups.end()) group = groups.insert(groups.end(), LossGroup{call.loss, {}, {}, {}});
        group->ins.push_back(std::move(in));
        group->dens.push_back(&pass.dens[r]);
        group->metrics.push_back(&pass.pending[r]);
      }
      at::Tensor total;
      for (const LossGroup& g : groups) {
        const at::Tensor loss = ComputeJointLoss(*g.config, g.ins, g.dens, g.metrics);
        total = total.defined() ? total + loss : loss;
      }
      if (total.defined()) total.backward();
    }
    // Every row's kernels finished, so the phase times what the device did (one wait).
    trainers.front()->SyncDevice();
    pass.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return absl::OkStatus();
  });
  for (const MicroBatchCounts& c : pass.counts) pass.joint_tokens += static_cast<double>(c.real_tokens);
  return pass;
}

absl::Status Trainer::FinishJointCall(const JointPass& pass, size_t r, const std::vector<JointTrainCall>& calls) {
  const size_t c = pass.admitted[r];
  Trainer& t = *calls[c].trainer;
  if (!pass.ran.ok()) {  // nothing of the step applies anywhere
    t.Restore(pass.snapshots[c]);
    return pass.ran;
  }
  if (pass.cancelled_before[r]) {  // its gradients so far go with the rest of its state
    t.Restore(pass.snapshots[c]);
    return CancelledBeforeMicroBatch(*pass.cancelled_before[r], pass.splits[r].size());
  }
  ++t.pending_backward_calls_;
  return absl::OkStatus();
}

void Trainer::AddJointMetrics(JointPass& pass, size_t r, Metrics* m) {
  pass.pending[r].Resolve(m);
  m->Add("tokens_nonpadding:sum", pass.counts[r].real_tokens);
  m->Add("tokens_loss:sum", pass.dens[r].loss_tokens);
  m->Add("micro_batches:sum", static_cast<double>(pass.splits[r].size()));
  m->Add("model_flops:sum", pass.counts[r].flops);
  m->Add("co_scheduled_runs:max", static_cast<double>(pass.admitted.size()));
  m->Add("co_scheduled_tokens:max", pass.joint_tokens);
  m->Add("co_scheduled_rows:sum", static_cast<double>(pass.rows));
  m->Add("co_scheduled_row_tokens:max", static_cast<double>(pass.longest_row));
  m->Add("time_forward_backward_joint_s:sum", pass.seconds);
}

void Trainer::StepJointOptimizers(JointPass& pass, const std::vector<size_t>& runs,
                                  const std::vector<JointTrainCall>& calls,
                                  std::vector<absl::StatusOr<OptimStepResult>>* results) {
  const auto t0 = std::chrono::steady_clock::now();
  auto refuse = [&](size_t r, const absl::Status& why) {
    const size_t c = pass.admitted[r];
    calls[c].trainer->Restore(pass.snapshots[c]);
    (*results)[c] = why;
  };
  // Every run's gradient norm in one pass on the device, then one wait for all of them.
  std::vector<size_t> normed;
  std::vector<std::vector<SquareTerm>> terms;
  for (size_t r : runs) {
    Trainer& t = *calls[pass.admitted[r]].trainer;
    if (absl::Status folded = FoldLocalGradients(t.adapter_.get()); !folded.ok()) {
      refuse(r, folded);
      continue;
    }
    normed.push_back(r);
    terms.push_back(SquaredGradNormTerms(*t.adapter_, nullptr));
  }
  if (normed.empty()) return;
  absl::StatusOr<at::Tensor> norms_or = GuardTorch([&]() -> absl::StatusOr<at::Tensor> {
    at::NoGradGuard no_grad;
    const at::Device device = calls[pass.admitted[normed.front()]].trainer->base_->device;
    return GroupSumsOfSquares(terms, device).sqrt_().to(at::kCPU).contiguous();
  });
  if (!norms_or.ok()) {
    for (size_t r : normed) refuse(r, norms_or.status());
    return;
  }
  const double* norms = norms_or->data_ptr<double>();
  // Every run's update staged aside on the device, then one wait checks them all: in batches
  // whose staged state stays within TrainerOptions::joint_optimizer_stage_bytes, each checked
  // and committed before the next is staged.
  std::vector<size_t> staged_runs;
  const int64_t cap = calls[pass.admitted[normed.front()]].trainer->options_.joint_optimizer_stage_bytes;
  for (size_t next = 0; next < normed.size();) {
    std::vector<size_t> batch_runs;
    std::vector<AdamW::StagedStep> staged;
    std::vector<at::Tensor> flags;
    for (int64_t bytes = 0; next < normed.size(); ++next) {
      const size_t r = normed[next];
      Trainer& t = *calls[pass.admitted[r]].trainer;
      const int64_t need = t.optimizer_->StagedBytes();
      if (!batch_runs.empty() && bytes + need > cap) break;
      bytes += need;
      absl::StatusOr<AdamW::StagedStep> step = GuardTorch([&]() -> absl::StatusOr<AdamW::StagedStep> {
        return t.optimizer_->StageOnDevice(calls[pass.admitted[r]].adamw, norms[next]);
      });
      t.AtStageFaultPoint(&step);
      if (!step.ok()) {
        refuse(r, step.status());
        continue;
      }
      if (step->largest.defined()) flags.push_back(step->largest.reshape({1}));
      batch_runs.push_back(r);
      staged.push_back(*std::move(step));
    }
    // The batch's largest magnitudes, with one wait (runs without parameters have none).
    absl::StatusOr<std::vector<float>> largest = GuardTorch([&]() -> absl::StatusOr<std::vector<float>> {
      if (flags.empty()) return std::vector<float>{};
      const at::Tensor host = at::cat(flags).to(at::kCPU).contiguous();
      return std::vector<float>(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
    });
    size_t flag = 0;
    for (size_t i = 0; i < batch_runs.size(); ++i) {
      const size_t r = batch_runs[i], c = pass.admitted[r];
      Trainer& t = *calls[c].trainer;
      std::optional<float> value;
      if (largest.ok() && staged[i].largest.defined()) value = (*largest)[flag++];
      absl::Status checked = !largest.ok() ? largest.status()
                                           : GuardTorch([&] { return t.optimizer_->CheckStaged(staged[i], value); });
      if (!checked.ok()) {
        refuse(r, checked);
        continue;
      }
      absl::StatusOr<OptimizerStepResult> step = GuardTorch([&]() -> absl::StatusOr<OptimizerStepResult> {
        return t.optimizer_->Commit(std::move(staged[i]));
      });
      staged_runs.push_back(r);
      if (!step.ok()) {  // after a partial commit the run's copy may differ from what it reports
        (*results)[c] = absl::DataLossError(absl::StrCat("optimizer: the step failed while committing (",
                                                         step.status().message(), ")"));
        continue;
      }
      t.pending_backward_calls_ = 0;
      OptimStepResult out;
      out.learner_version = t.optimizer_->steps_taken();
      out.metrics.Add("grad_norm:sum", step->grad_norm);
      out.metrics.Add("lr:sum", step->lr);
      AddJointMetrics(pass, r, &out.metrics);
      (*results)[c] = std::move(out);
    }
  }
  if (staged_runs.empty()) return;
  calls[pass.admitted[staged_runs.front()]].trainer->SyncDevice();  // the commits, in the time
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t r : staged_runs) {
    auto& result = (*results)[pass.admitted[r]];
    if (result.ok()) result->metrics.Add("time_optimizer_s:sum", seconds);  // shared by the step's runs
  }
}

std::vector<absl::StatusOr<OptimStepResult>> Trainer::JointTrainStep(const std::vector<JointTrainCall>& calls) {
  // Benchmarks: the joint step in which any of its runs reaches its profile_train_step.
  const Trainer* profiled = JointProfiledTrainer(calls);
  if (profiled != nullptr) {
    profiled->SyncDevice();
    if (absl::Status s = StartKernelProfile(); !s.ok()) LORASTEP_LOG(Warning) << "joint step profile: " << s;
  }
  std::vector<absl::StatusOr<OptimStepResult>> results = JointTrainStepUnprofiled(calls);
  if (profiled != nullptr) {
    profiled->SyncDevice();
    const std::string& trace = profiled->options_.profile_trace_path;
    if (absl::Status s = StopKernelProfile(trace); !s.ok()) LORASTEP_LOG(Warning) << "joint step profile: " << s;
  }
  return results;
}

const Trainer* Trainer::JointProfiledTrainer(const std::vector<JointTrainCall>& calls) {
  const Trainer* profiled = nullptr;
  for (const JointTrainCall& call : calls) {
    if (call.trainer == nullptr || call.trainer->options_.profile_trace_path.empty()) continue;
    if (++call.trainer->train_steps_run_ == call.trainer->options_.profile_train_step) profiled = call.trainer;
  }
  return profiled;
}

std::vector<absl::StatusOr<OptimStepResult>> Trainer::JointTrainStepUnprofiled(
    const std::vector<JointTrainCall>& calls) {
  const auto t0 = std::chrono::steady_clock::now();
  JointPass pass = RunJointPass(calls, JointKind::kTrainStep);
  std::vector<absl::StatusOr<OptimStepResult>> results = WithRefusals<OptimStepResult>(pass.refused);
  // Each run's own optimizer step, all in one pass: a refusal undoes that run alone.
  std::vector<size_t> finished;
  for (size_t r = 0; r < pass.admitted.size(); ++r) {
    const size_t c = pass.admitted[r];
    if (absl::Status done = FinishJointCall(pass, r, calls); !done.ok()) {
      results[c] = done;
      continue;
    }
    finished.push_back(r);
  }
  StepJointOptimizers(pass, finished, calls, &results);
  // Every stepped run's adapter digest, hashed together (one kernel, one wait).
  std::vector<size_t> stepped;
  std::vector<std::vector<at::Tensor>> adapters;
  for (size_t c : pass.admitted) {
    if (!results[c].ok()) continue;
    stepped.push_back(c);
    adapters.emplace_back();
    for (const Parameter& p : calls[c].trainer->adapter_->parameters()) adapters.back().push_back(p.value);
  }
  if (!stepped.empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::string> digests = TensorGroupsSha256(adapters);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (size_t i = 0; i < stepped.size(); ++i) {
      results[stepped[i]]->adapter_sha256 = digests[i];
      results[stepped[i]]->metrics.Add("time_digest_s:sum", seconds);  // shared by the step's runs
    }
  }
  const double step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t c : stepped) results[c]->metrics.Add("time_step_s:sum", step_seconds);  // the joint step's
  for (size_t c : pass.alone) {  // on their own, after the joint part
    BatchOptions batch;
    batch.max_tokens_per_microbatch = calls[c].max_tokens_per_microbatch;
    batch.totals = calls[c].totals;
    results[c] = calls[c].trainer->TrainStep(*calls[c].datums, *calls[c].loss, calls[c].adamw, batch);
  }
  return results;
}

std::vector<absl::StatusOr<ForwardBackwardResult>> Trainer::JointForwardBackward(
    const std::vector<JointTrainCall>& calls) {
  JointPass pass = RunJointPass(calls, JointKind::kForwardBackward);
  std::vector<absl::StatusOr<ForwardBackwardResult>> results = WithRefusals<ForwardBackwardResult>(pass.refused);
  for (size_t r = 0; r < pass.admitted.size(); ++r) {
    const size_t c = pass.admitted[r];
    if (absl::Status finished = FinishJointCall(pass, r, calls); !finished.ok()) {
      results[c] = finished;
      continue;
    }
    ForwardBackwardResult out;
    out.logprobs = GatherLogprobs(*calls[c].datums, pass.logprobs[r]);
    AddJointMetrics(pass, r, &out.metrics);
    out.metrics.Set("peak_host_memory_bytes:max", PeakHostMemoryBytes());
    calls[c].trainer->AddCudaPeakMemory(&out.metrics);
    results[c] = std::move(out);
  }
  for (size_t c : pass.alone) {
    BatchOptions batch;
    batch.max_tokens_per_microbatch = calls[c].max_tokens_per_microbatch;
    batch.totals = calls[c].totals;
    results[c] = calls[c].trainer->ForwardBackward(*calls[c].datums, *calls[c].loss, batch);
  }
  return results;
}

std::vector<absl::StatusOr<ForwardBackwardResult>> Trainer::JointForward(const std::vector<JointForwardCall>& calls) {
  std::vector<JointTrainCall> as_pass;
  for (const JointForwardCall& call : calls) {
    JointTrainCall c;
    c.trainer = call.trainer;
    c.datums = call.datums;
    c.cancelled = call.cancelled;
    as_pass.push_back(std::move(c));
  }
  JointPass pass = RunJointPass(as_pass, JointKind::kForward);
  std::vector<absl::StatusOr<ForwardBackwardResult>> results = WithRefusals<ForwardBackwardResult>(pass.refused);
  for (size_t r = 0; r < pass.admitted.size(); ++r) {
    const size_t c = pass.admitted[r];
    if (!pass.ran.ok()) {
      results[c] = pass.ran;
      continue;
    }
    if (pass.cancelled_before[r]) {
      results[c] = CancelledBeforeMicroBatch(*pass.cancelled_before[r], pass.splits[r].size());
      continue;
    }
    ForwardBackwardResult out;
    out.logprobs = GatherLogprobs(*calls[c].datums, pass.logprobs[r]);
    Metrics& m = out.metrics;
    pass.pending[r].Resolve(&m);
    m.Add("tokens_physical:sum", pass.counts[r].physical);
    m.Add("tokens_nonpadding:sum", pass.counts[r].real_tokens);
    m.Add("tokens_scored:sum", pass.scored[r]);
    m.Add("micro_batches:sum", static_cast<double>(pass.splits[r].size()));
    m.Add("model_flops:sum", pass.counts[r].flops);
    m.Add("time_forward_s:sum", pass.seconds);  // the shared passes' wall time
    if (pass.seconds > 0) m.Add("tokens_per_s:sum", pass.counts[r].real_tokens / pass.seconds);
    m.Add("co_scheduled_runs:max", static_cast<double>(pass.admitted.size()));
    m.Add("co_scheduled_tokens:max", pass.joint_tokens);
    m.Add("co_scheduled_rows:sum", static_cast<double>(pass.rows));
    m.Add("co_scheduled_row_tokens:max", static_cast<double>(pass.longest_row));
    m.Set("peak_host_memory_bytes:max", PeakHostMemoryBytes());
    calls[c].trainer->AddCudaPeakMemory(&m);
    results[c] = std::move(out);
  }
  return results;
}

bool Trainer::CoSchedulable() const {
  return options_.groups == nullptr && !adapter_->full_finetune() && !base_->config.is_moe() &&
         options_.pack_sequences;
}

}  // namespace lorastep
