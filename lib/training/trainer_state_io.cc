// The Trainer's state in and out: whole tensors gathered from tensor, expert and pipeline
// ranks; checkpoints (SaveState, LoadState, snapshots written in the background); PEFT
// adapters (ExportAdapter, ImportAdapter); the adapter's digest. Members of Trainer
// (lib/training/trainer.h), apart from its step.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/device_stats.h"
#include "lib/io/checkpoint_dir.h"
#include "lib/io/digest.h"
#include "lib/io/file_util.h"
#include "lib/io/safetensors.h"
#include "lib/io/tensor_bytes.h"
#include "lib/model/peft_io.h"
#include "lib/parallel/parallel_layout.h"
#include "lib/status_macros.h"
#include "lib/torch_status.h"
#include "lib/training/stage_gather.h"
#include "lib/training/trainer.h"
#include "nlohmann/json.hpp"

namespace lorastep {
namespace {

constexpr int kStateFormatVersion = 1;

// A list of tensors as it was at SnapshotState, detached from the live ones: flattened into
// one fresh buffer (on the device: one kernel, not one synchronous device-to-host copy per
// tensor, 1,344 of them for a rank-32 adapter of the 0.5B model), brought to the host only
// when written (DeferredHostCopy: on CUDA from a side stream, off the step's path).
struct SnapshotList {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  DeferredHostCopy flat;                // all tensors of one dtype and device, flattened
  std::vector<at::Tensor> one_by_one;   // otherwise (mixed dtypes): host copies
  std::vector<at::Tensor> live;         // SaveState: the live tensors, written before the next call

  static SnapshotList Of(const std::vector<std::pair<std::string, at::Tensor>>& named, bool copy) {
    SnapshotList list;
    std::vector<at::Tensor> flat;
    for (const auto& [name, t] : named) {
      list.names.push_back(name);
      list.shapes.emplace_back(t.sizes().begin(), t.sizes().end());
      if (!copy) {
        list.live.push_back(t);
      } else if (flat.empty() || (t.scalar_type() == flat[0].scalar_type() && t.device() == flat[0].device())) {
        flat.push_back(t.detach().reshape({-1}));
      }
    }
    if (!copy || named.empty()) return list;
    if (flat.size() == named.size()) {
      list.flat = DeferredHostCopy::Start(at::cat(flat));  // a fresh buffer: on CPU it is the copy
    } else {
      for (const auto& [name, t] : named) list.one_by_one.push_back(t.detach().to(at::kCPU, false, /*copy=*/true));
    }
    return list;
  }

  absl::Status AddTo(TensorWriteList* out) const {
    if (!live.empty() || !one_by_one.empty()) {
      const auto& tensors = live.empty() ? one_by_one : live;
      for (size_t i = 0; i < names.size(); ++i) LORASTEP_RETURN_IF_ERROR(out->Add(names[i], tensors[i]));
      return absl::OkStatus();
    }
    if (names.empty()) return absl::OkStatus();
    const at::Tensor all = flat.Finish();
    int64_t at = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      LORASTEP_RETURN_IF_ERROR(out->Add(names[i], all.narrow(0, at, n).view(shapes[i])));
      at += n;
    }
    return absl::OkStatus();
  }
};

}  // namespace

bool Trainer::WritesGatheredState() const {
  if (options_.groups == nullptr) return true;
  const RankCoords c = options_.groups->coords();
  return c.tp == 0 && c.pp == 0 && c.dp == 0 && c.cp == 0;
}

absl::StatusOr<std::vector<at::Tensor>> Trainer::GatherTensorSplits(
    const std::vector<at::Tensor>& local) const {
  const auto& params = adapter_->parameters();
  if (options_.groups == nullptr || (base_->shard.tp == 1 && base_->shard.ep == 1)) return local;
  CommGroup& tp = options_.groups->group(GroupKind::kTensor);
  CommGroup& ep = options_.groups->group(GroupKind::kExpert);
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor t = local[i];
    if (params[i].expert_split && ep.size() > 1) {  // experts: equal counts, in ep-rank order
      LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> parts, ep.AllGather(t));
      t = at::cat(parts, 0);
    }
    if (TensorReplicated(params[i].role) || tp.size() == 1) {
      full.push_back(t);
      continue;
    }
    // Slices may differ by one row (an uneven vocabulary split): pad to the largest,
    // gather, trim each to its own size, concatenate in tensor-rank order.
    const int dim = params[i].split_dim;
    at::Tensor size = at::full({1}, static_cast<double>(t.size(dim)),
                               t.options().dtype(at::kDouble));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> sizes, tp.AllGather(size));
    int64_t largest = 0;
    for (const auto& n : sizes) largest = std::max<int64_t>(largest, static_cast<int64_t>(n.item<double>()));
    at::Tensor padded = t;
    if (padded.size(dim) < largest) {
      std::vector<int64_t> pad_shape(padded.sizes().begin(), padded.sizes().end());
      pad_shape[dim] = largest - padded.size(dim);
      padded = at::cat({padded, at::zeros(pad_shape, padded.options())}, dim);
    }
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> parts, tp.AllGather(padded));
    for (size_t r = 0; r < parts.size(); ++r) {
      parts[r] = parts[r].narrow(dim, 0, static_cast<int64_t>(sizes[r].item<double>()));
    }
    full.push_back(params[i].split_groups.empty() ? at::cat(parts, dim)
                                                  : JoinGroupedSplit(parts, params[i].split_groups, dim));
  }
  return full;
}

absl::StatusOr<std::vector<NamedTensor>> Trainer::GatherStages(
    std::vector<NamedTensor> local) const {
  if (options_.groups == nullptr || base_->shard.pp == 1) return local;
  const RankCoords c = options_.groups->coords();
  if (c.tp != 0 || c.dp != 0 || c.cp != 0) return local;  // replica 0's tensor rank 0 of each stage takes part
  return GatherStagesToFirst(options_.groups->group(GroupKind::kPipeline), std::move(local), base_->device);
}

absl::StatusOr<std::vector<NamedTensor>> Trainer::WholeAdapter() const {
  std::vector<at::Tensor> local;
  for (const Parameter& p : adapter_->parameters()) local.push_back(p.value);
  LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full, GatherTensorSplits(local));
  std::vector<NamedTensor> named;
  for (size_t i = 0; i < full.size(); ++i) named.push_back({adapter_->parameters()[i].name, full[i]});
  return GatherStages(std::move(named));
}

absl::Status Trainer::ExportAdapter(const std::string& folder, bool expand_experts) const {
  return GuardTorch([&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(std::vector<NamedTensor> whole, WholeAdapter());
    if (!WritesGatheredState()) return absl::OkStatus();
    if (adapter_->full_finetune()) return ExportPeftAdapter(folder, *adapter_, base_->path, &whole, {});  // refused
    // Written aside and renamed into place: a failed export leaves no partial folder.
    return WriteFolderAtomically(folder, [&](const std::string& tmp) {
      return ExportPeftAdapter(tmp, *adapter_, base_->path, &whole,
                               PeftOptionsFor(base_->config, adapter_->lora_config(), expand_experts));
    });
  });
}

void Trainer::ResetOptimizer() {
  optimizer_->ResyncFromParameters();
  optimizer_->set_steps_taken(0);
  adapter_->ZeroMainGrads();
  pending_backward_calls_ = 0;
}

absl::Status Trainer::ImportAdapter(const std::string& folder) {
  if (options_.groups != nullptr && options_.groups->layout().world_size() > 1) {
    return absl::FailedPreconditionError("import: adapter import on a mesh is not built yet; "
                                         "import at world size 1 and SaveState/LoadState");
  }
  return GuardTorch([&]() -> absl::Status {
    LORASTEP_RETURN_IF_ERROR(
        ImportPeftAdapter(folder, adapter_.get(), PeftOptionsFor(base_->config, adapter_->lora_config(), false)));
    optimizer_->ResyncFromParameters();
    adapter_->ZeroMainGrads();
    pending_backward_calls_ = 0;
    return absl::OkStatus();
  });
}

std::string Trainer::FullAdapterSha256() const {
  auto whole = GuardTorch([&] { return WholeAdapter(); });
  if (!whole.ok() || !WritesGatheredState()) return "";
  std::vector<at::Tensor> values;
  for (const auto& [name, t] : *whole) values.push_back(t);
  return TensorsSha256(values);
}

struct TrainerStateSnapshot {
  bool writes = false;  // this rank writes the gathered state
  SnapshotList trainable, optimizer;
  at::Tensor dropout_rng;
  std::string state_json;
};

absl::StatusOr<std::shared_ptr<const TrainerStateSnapshot>> Trainer::Snapshot(bool copy) const {
  return GuardTorch([&]() -> absl::StatusOr<std::shared_ptr<const TrainerStateSnapshot>> {
    // Layout-independent: tensor-parallel slices are gathered into whole tensors and the
    // stages' tensors into one list, so a checkpoint saved on any mesh loads on any other
    // (and at world size 1).
    const auto& params = adapter_->parameters();
    std::vector<at::Tensor> values;
    for (const Parameter& p : params) values.push_back(p.value);
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_values, GatherTensorSplits(values));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_master, GatherTensorSplits(optimizer_->master()));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_avg, GatherTensorSplits(optimizer_->exp_avg()));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<at::Tensor> full_avg_sq,
                              GatherTensorSplits(optimizer_->exp_avg_sq()));
    std::vector<NamedTensor> trainable_local, optimizer_local;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].stage_copy) continue;  // the first stage writes the tied embedding
      trainable_local.push_back({params[i].name, full_values[i]});
      optimizer_local.push_back({params[i].name + ".master", full_master[i]});
      optimizer_local.push_back({params[i].name + ".exp_avg", full_avg[i]});
      optimizer_local.push_back({params[i].name + ".exp_avg_sq", full_avg_sq[i]});
    }
    LORASTEP_ASSIGN_OR_RETURN(std::vector<NamedTensor> trainable_all, GatherStages(std::move(trainable_local)));
    LORASTEP_ASSIGN_OR_RETURN(std::vector<NamedTensor> optimizer_all, GatherStages(std::move(optimizer_local)));
    auto snapshot = std::make_shared<TrainerStateSnapshot>();
    snapshot->writes = WritesGatheredState();
    if (!snapshot->writes) return std::shared_ptr<const TrainerStateSnapshot>(std::move(snapshot));
    // Values (model dtype) apart from the fp32 optimizer state.
    snapshot->trainable = SnapshotList::Of(trainable_all, copy);
    snapshot->optimizer = SnapshotList::Of(optimizer_all, copy);
    snapshot->dropout_rng = dropout_generator_.get_state();
    const LoraConfig& lora = adapter_->lora_config();
    nlohmann::ordered_json state;
    state["format_version"] = kStateFormatVersion;
    state["optimizer_steps"] = optimizer_->steps_taken();
    state["lora"] = {{"rank", lora.rank}, {"alpha", lora.alpha}, {"dropout", lora.dropout},
                     {"target_modules", lora.target_modules}, {"expert_lora", lora.expert_lora}};
    state["base_model"] = base_->path;
    state["parameter_count"] = trainable_all.size();
    snapshot->state_json = state.dump(2) + "\n";
    return std::shared_ptr<const TrainerStateSnapshot>(std::move(snapshot));
  });
}

absl::StatusOr<std::shared_ptr<const TrainerStateSnapshot>> Trainer::SnapshotState() const {
  return Snapshot(/*copy=*/true);
}

absl::Status Trainer::WriteStateSnapshot(const TrainerStateSnapshot& snapshot, const std::string& folder,
                                         const std::function<absl::Status(const std::string&)>& fault_point) {
  if (!snapshot.writes) return absl::OkStatus();
  return GuardTorch([&]() -> absl::Status {
    TensorWriteList trainable, optimizer;
    LORASTEP_RETURN_IF_ERROR(snapshot.trainable.AddTo(&trainable));
    LORASTEP_RETURN_IF_ERROR(snapshot.optimizer.AddTo(&optimizer));
    LORASTEP_RETURN_IF_ERROR(optimizer.Add("rng.dropout", snapshot.dropout_rng));
    auto write = [&](const std::string& tmp) -> absl::Status {
      LORASTEP_RETURN_IF_ERROR(trainable.WriteTo(tmp + "/trainable.safetensors"));
      if (fault_point) LORASTEP_RETURN_IF_ERROR(fault_point("trainable_written"));
      LORASTEP_RETURN_IF_ERROR(optimizer.WriteTo(tmp + "/optimizer.safetensors"));
      return WriteStringToFile(tmp + "/trainer_state.json", snapshot.state_json);
    };
    return WriteFolderAtomically(folder, write, fault_point);
  });
}

absl::Status Trainer::SaveState(
    const std::string& folder,
    const std::function<absl::Status(const std::string&)>& fault_point) const {
  // Written before the next call: the host tensors may alias the live ones (CPU).
  LORASTEP_ASSIGN_OR_RETURN(auto snapshot, Snapshot(/*copy=*/false));
  return WriteStateSnapshot(*snapshot, folder, fault_point);
}

absl::Status Trainer::LoadState(const std::string& folder, MeshVote* caller_vote) {
  // Every early return below votes "no" through the guard: the other ranks learn at once.
  std::optional<MeshVote> own_vote;
  if (caller_vote == nullptr) own_vote.emplace(options_.groups, base_->device);
  MeshVote& vote = caller_vote != nullptr ? *caller_vote : *own_vote;
  return GuardTorch([&]() -> absl::Status {
    LORASTEP_ASSIGN_OR_RETURN(std::string text, ReadFileToString(folder + "/trainer_state.json"));
    nlohmann::json state = nlohmann::json::parse(text, nullptr, false);
    const std::string where = folder + "/trainer_state.json";
    if (state.is_discarded() || !state.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    if (!state.contains("format_version") || !state["format_version"].is_number_integer() ||
        state["format_version"].get<int64_t>() != kStateFormatVersion) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": format_version: must be ", kStateFormatVersion));
    }
    // Every field is checked before anything is staged: a malformed file changes nothing.
    if (!state.contains("optimizer_steps") || !state["optimizer_steps"].is_number_integer() ||
        state["optimizer_steps"].get<int64_t>() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": optimizer_steps: must be an integer >= 0"));
    }
    if (!state.contains("lora") || !state["lora"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": lora: must be an object"));
    }
    const LoraConfig& lora = adapter_->lora_config();
    if (state["lora"].contains("expert_lora") && !state["lora"]["expert_lora"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": lora.expert_lora: must be a string"));
    }
    const std::string saved_layout = state["lora"].value("expert_lora", std::string("per_expert"));
    if (saved_layout != lora.expert_lora) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": lora.expert_lora '", saved_layout,
                                                     "' differs from this run's '", lora.expert_lora, "'"));
    }
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
      if (base_->shard.ep > 1 && param.expert_split && t.dim() == like.dim()) {
        t = t.narrow(0, base_->shard.expert_begin, base_->shard.expert_end - base_->shard.expert_begin);
      }
      if (tp > 1 && !TensorReplicated(param.role) && t.dim() == like.dim() && t.dim() > param.split_dim) {
        if (!param.split_groups.empty()) {  // each group's even share (in_proj_qkv's B)
          LinearSplit split;
          split.dim = param.split_dim;
          split.groups = param.split_groups;
          t = CutLinearSplit(t, split, tp, tp_rank);
        } else {
          const auto [begin, end] = EvenRange(t.size(param.split_dim), tp, tp_rank);
          t = t.narrow(param.split_dim, begin, end - begin);
        }
      }
      if (!t.sizes().equals(like.sizes())) {
        return absl::InvalidArgumentError(
            absl::StrCat(file.path(), ": tensor '", name, "': shape mismatch"));
      }
      if (t.is_floating_point() && !at::isfinite(t).all().item<bool>()) {
        return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name, "': holds non-finite values"));
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
      // The trainable weights are the fp32 master copy in their dtype: a checkpoint where they
      // disagree would train on one and step from the other.
      if (!at::equal(ms.to(v.scalar_type()), v)) {
        return absl::InvalidArgumentError(absl::StrCat(trainable.path(), ": tensor '", params[i].name,
                                                       "': differs from its fp32 master copy in ",
                                                       optimizer.path()));
      }
      values.push_back(v);
      master.push_back(ms);
      avg.push_back(a);
      avg_sq.push_back(s);
    }
    LORASTEP_ASSIGN_OR_RETURN(const SafetensorsEntry* rng, optimizer.Find("rng.dropout"));
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor rng_state, TensorFromEntry(*rng));
    LORASTEP_RETURN_IF_ERROR(vote.Cast(absl::OkStatus()));
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
