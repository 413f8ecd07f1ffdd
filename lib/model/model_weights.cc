#include "lib/model/model_weights.h"

#include <ATen/CPUGeneratorImpl.h>

#include <initializer_list>
#include <map>
#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lib/io/file_util.h"
#include "lib/log.h"
#include "lib/model/gpt_oss_layout.h"
#include "lib/io/safetensors.h"
#include "lib/status_macros.h"
#include "lib/io/tensor_bytes.h"
#include "lib/torch_status.h"
#include "nlohmann/json.hpp"

namespace lorastep {
namespace {

const char* const kBiasNames[3] = {"q_proj", "k_proj", "v_proj"};

template <typename Weights, typename Fn>
void VisitNamed(Weights& w, Fn&& fn) {
  fn("model.embed_tokens.weight", w.embed_tokens);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    auto& layer = w.layers[i];
    const LayerLayout& lay = layer.layout;
    const std::string prefix = absl::StrCat("model.layers.", w.first_layer + static_cast<int64_t>(i), ".");
    fn(prefix + "input_layernorm.weight", layer.input_norm);
    for (int s = 0; s < kNumLinearSlots; ++s) {
      if (!lay.HasLinear(s)) continue;
      if (IsLinearAttentionSlot(s)) {
        fn(absl::StrCat(prefix, LinearSlotModulePath(s), ".weight"), layer.linear[s]);
        continue;
      }
      if (s >= kGateProj) {
        if (!lay.mlp_slots) continue;
        // On a MoE layer these slots are Qwen2-MoE's shared expert.
        const std::string module = lay.moe ? absl::StrCat("mlp.shared_expert.", LinearSlotName(s))
                                           : LinearSlotModulePath(s);
        fn(absl::StrCat(prefix, module, ".weight"), layer.linear[s]);
        continue;
      }
      fn(absl::StrCat(prefix, LinearSlotModulePath(s), ".weight"), layer.linear[s]);
      if (s < 3 && lay.qkv_bias) fn(absl::StrCat(prefix, "self_attn.", kBiasNames[s], ".bias"), layer.qkv_bias[s]);
      if (s == kOProj && lay.o_bias) fn(prefix + "self_attn.o_proj.bias", layer.o_bias);
    }
    if (lay.sinks) fn(prefix + "self_attn.sinks", layer.sinks);
    if (lay.linear_attention) {
      fn(prefix + "linear_attn.conv1d.weight", layer.conv1d);
      fn(prefix + "linear_attn.A_log", layer.a_log);
      fn(prefix + "linear_attn.dt_bias", layer.dt_bias);
      fn(prefix + "linear_attn.norm.weight", layer.linear_norm);
    }
    if (lay.qk_norm && !lay.linear_attention) {
      fn(prefix + "self_attn.q_norm.weight", layer.q_norm);
      fn(prefix + "self_attn.k_norm.weight", layer.k_norm);
    }
    if (lay.moe && lay.gpt_oss) {
      fn(prefix + "mlp.router.weight", layer.router);
      fn(prefix + "mlp.router.bias", layer.router_bias);
      fn(prefix + "mlp.experts.gate_up_proj", layer.experts_gate_up);
      fn(prefix + "mlp.experts.gate_up_proj_bias", layer.experts_gate_up_bias);
      fn(prefix + "mlp.experts.down_proj", layer.experts_down);
      fn(prefix + "mlp.experts.down_proj_bias", layer.experts_down_bias);
    } else if (lay.moe) {
      fn(prefix + "mlp.gate.weight", layer.router);
      fn(prefix + "mlp.experts.gate_up_proj", layer.experts_gate_up);
      fn(prefix + "mlp.experts.down_proj", layer.experts_down);
      if (lay.shared_expert_gate) fn(prefix + "mlp.shared_expert_gate.weight", layer.shared_expert_gate);
    }
    fn(prefix + "post_attention_layernorm.weight", layer.post_attention_norm);
  }
  fn("model.norm.weight", w.final_norm);
  if (w.lm_head.defined()) fn("lm_head.weight", w.lm_head);
}

// Finds which file holds each tensor: one model.safetensors, or an index's weight_map.
absl::StatusOr<std::map<std::string, std::string>> TensorFiles(const std::string& folder) {
  std::map<std::string, std::string> files;
  const std::string index_path = folder + "/model.safetensors.index.json";
  if (PathExists(index_path)) {
    LORASTEP_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
    nlohmann::json index = nlohmann::json::parse(text, nullptr, false);
    if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": no weight_map object"));
    }
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      files[it.key()] = folder + "/" + it->get<std::string>();
    }
    return files;
  }
  const std::string single = folder + "/model.safetensors";
  if (!PathExists(single)) {
    return absl::NotFoundError(
        absl::StrCat(folder, ": neither model.safetensors nor model.safetensors.index.json"));
  }
  files["*"] = single;
  return files;
}

std::vector<int64_t> Shape(const at::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

}  // namespace

void ForEachNamedTensor(ModelWeights& weights,
                        const std::function<void(const std::string&, at::Tensor&)>& fn) {
  VisitNamed(weights, fn);
}

void ForEachNamedTensor(const ModelWeights& weights,
                        const std::function<void(const std::string&, const at::Tensor&)>& fn) {
  VisitNamed(weights, fn);
}

LayerLayout LayoutOfLayer(const ModelConfig& c, int64_t layer) {
  LayerLayout l;
  l.qkv_bias = c.qkv_bias();
  l.qk_norm = c.qk_norm();
  l.moe = c.IsMoeLayer(layer);
  l.mlp_slots = !l.moe || c.moe.shared_expert_intermediate_size > 0;
  l.shared_expert_gate = l.moe && c.moe.shared_expert_intermediate_size > 0;
  l.o_bias = c.o_bias();
  l.sinks = c.attention_sinks();
  l.gpt_oss = c.gpt_oss();
  l.linear_attention = c.IsLinearAttentionLayer(layer);
  return l;
}

ModelWeights ModelSkeleton(const ModelConfig& c) {
  const at::TensorOptions meta = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);
  const int64_t h = c.hidden_size, d = c.head_dim(), q = c.num_attention_heads * d,
                kv = c.num_key_value_heads * d;
  auto t = [&](std::vector<int64_t> shape) { return at::empty(shape, meta); };
  ModelWeights w;
  w.embed_tokens = t({c.vocab_size, h});
  w.final_norm = t({h});
  if (!c.tie_word_embeddings) w.lm_head = t({c.vocab_size, h});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights l;
    l.layout = LayoutOfLayer(c, i);
    l.input_norm = t({h});
    l.post_attention_norm = t({h});
    if (l.layout.linear_attention) {
      const LinearAttentionConfig& la = c.linear_attention;
      for (int slot = kInProjQkv; slot < kOutProj; ++slot) l.linear[slot] = t({c.LinearAttentionWidth(slot), h});
      l.linear[kOutProj] = t({h, la.value_dim()});
      l.conv1d = t({la.conv_dim(), 1, la.conv_kernel});
      l.a_log = t({la.num_value_heads});
      l.dt_bias = t({la.num_value_heads});
      l.linear_norm = t({la.value_head_dim});
    } else {
      l.linear[kQProj] = t({c.gated_attention() ? 2 * q : q, h});  // Qwen3.5: each head's query, then its gate
      l.linear[kKProj] = t({kv, h});
      l.linear[kVProj] = t({kv, h});
      l.linear[kOProj] = t({h, q});
    }
    if (l.layout.qkv_bias) l.qkv_bias = {t({q}), t({kv}), t({kv})};
    if (l.layout.o_bias) l.o_bias = t({h});
    if (l.layout.sinks) l.sinks = t({c.num_attention_heads});
    if (l.layout.qk_norm && !l.layout.linear_attention) {
      l.q_norm = t({d});
      l.k_norm = t({d});
    }
    if (l.layout.mlp_slots) {
      const int64_t f = l.layout.moe ? c.moe.shared_expert_intermediate_size : c.intermediate_size;
      l.linear[kGateProj] = t({f, h});
      l.linear[kUpProj] = t({f, h});
      l.linear[kDownProj] = t({h, f});
    }
    if (l.layout.moe) {
      const int64_t e = c.moe.num_experts, f = c.moe.moe_intermediate_size;
      l.router = t({e, h});
      l.experts_gate_up = t({e, 2 * f, h});
      l.experts_down = t({e, h, f});
      if (l.layout.shared_expert_gate) l.shared_expert_gate = t({1, h});
      if (c.router_bias()) l.router_bias = t({e});
      if (c.expert_bias()) {
        l.experts_gate_up_bias = t({e, 2 * f});
        l.experts_down_bias = t({e, h});
      }
    }
    w.layers.push_back(std::move(l));
  }
  return w;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedTensorShapes(
    const ModelConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  ForEachNamedTensor(ModelSkeleton(c), [&](const std::string& name, const at::Tensor& t) {
    out.emplace_back(name, std::vector<int64_t>(t.sizes().begin(), t.sizes().end()));
  });
  return out;
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& folder, const at::Device& device,
                                      c10::optional<at::ScalarType> dtype) {
  LoadedModel model;
  LORASTEP_ASSIGN_OR_RETURN(std::string config_text, ReadFileToString(folder + "/config.json"));
  LORASTEP_ASSIGN_OR_RETURN(model.config, ParseModelConfigJson(config_text));
  at::ScalarType type;
  if (dtype.has_value()) {
    type = *dtype;
  } else {
    LORASTEP_ASSIGN_OR_RETURN(type, ScalarTypeFromName(model.config.torch_dtype));
  }
  LORASTEP_ASSIGN_OR_RETURN(auto files, TensorFiles(folder));
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_files;
  auto open_file = [&](const std::string& path) -> absl::StatusOr<SafetensorsFile*> {
    auto it = open_files.find(path);
    if (it != open_files.end()) return it->second.get();
    LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(path));
    auto owned = std::make_unique<SafetensorsFile>(std::move(f));
    SafetensorsFile* raw = owned.get();
    open_files[path] = std::move(owned);
    return raw;
  };

  // One tensor by name, shape-checked, on the device in the model dtype.
  // keep_type: as stored (MXFP4's uint8 blocks and scales), else in the model dtype.
  // A vision-language folder keeps its text model under model.language_model.
  auto stored_name = [&](const std::string& name) {
    return model.config.language_model_of_vl && absl::StartsWith(name, "model.")
               ? absl::StrCat("model.language_model.", name.substr(6))
               : name;
  };
  auto load = [&](const std::string& wanted, const std::vector<int64_t>& shape,
                  bool keep_type = false) -> absl::StatusOr<at::Tensor> {
    const std::string name = stored_name(wanted);
    auto file_it = files.count("*") ? files.find("*") : files.find(name);
    if (file_it == files.end()) {
      return absl::InvalidArgumentError(absl::StrCat(folder, ": tensor '", name,
                                                     "' is not in the weight map"));
    }
    LORASTEP_ASSIGN_OR_RETURN(SafetensorsFile * file, open_file(file_it->second));
    auto entry = file->Find(name);
    if (!entry.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(file->path(), ": missing tensor '", name, "'"));
    }
    if ((*entry)->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          file->path(), ": tensor '", name, "': shape mismatch: config.json implies [",
          absl::StrJoin(shape, ", "), "], file has [", absl::StrJoin((*entry)->shape, ", "), "]"));
    }
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor cpu, TensorFromEntry(**entry));
    return GuardTorch([&]() -> absl::StatusOr<at::Tensor> { return keep_type ? cpu.to(device) : cpu.to(device, type); });
  };
  auto has = [&](const std::string& wanted) {
    const std::string name = stored_name(wanted);
    if (!files.count("*")) return files.count(name) > 0;
    auto file = open_file(files.at("*"));
    return file.ok() && (*file)->Find(name).ok();
  };
  // Stacked experts, or assembled from one module per expert.
  auto load_experts = [&](const std::string& name, const std::vector<int64_t>& shape) -> absl::StatusOr<at::Tensor> {
    if (has(name)) return load(name, shape);
    const std::string base = name.substr(0, name.rfind('.'));  // model.layers.N.mlp.experts
    const bool gate_up = absl::EndsWith(name, "gate_up_proj");
    const int64_t f = gate_up ? shape[1] / 2 : shape[2], h = gate_up ? shape[2] : shape[1];
    std::vector<at::Tensor> experts;
    for (int64_t e = 0; e < shape[0]; ++e) {
      const std::string prefix = absl::StrCat(base, ".", e, ".");
      if (gate_up) {
        LORASTEP_ASSIGN_OR_RETURN(at::Tensor g, load(prefix + "gate_proj.weight", {f, h}));
        LORASTEP_ASSIGN_OR_RETURN(at::Tensor u, load(prefix + "up_proj.weight", {f, h}));
        experts.push_back(at::cat({g, u}, 0));
      } else {
        LORASTEP_ASSIGN_OR_RETURN(at::Tensor dn, load(prefix + "down_proj.weight", {h, f}));
        experts.push_back(dn);
      }
    }
    return GuardTorch([&]() -> absl::StatusOr<at::Tensor> { return at::stack(experts); });
  };

  // gpt-oss's experts: stored [E, in, out] (interleaved gate/up), or MXFP4 blocks and scales
  // of the [E, out, in] layout, whichever the folder has.
  auto load_gpt_oss = [&](const std::string& name, GptOssExpertTensor which,
                          const std::vector<int64_t>& shape) -> absl::StatusOr<at::Tensor> {
    const bool matrix = which == GptOssExpertTensor::kGateUp || which == GptOssExpertTensor::kDown;
    if (matrix && !has(name) && has(name + "_blocks")) {
      // shape: lorastep's [E, out, in], the blocks' layout before the interleave is undone
      const int64_t groups = shape[2] / 32;
      if (shape[2] % 32 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(name, "_blocks: in-features ", shape[2], " not a multiple of 32"));
      }
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor blocks, load(name + "_blocks", {shape[0], shape[1], groups, 16}, true));
      LORASTEP_ASSIGN_OR_RETURN(at::Tensor scales, load(name + "_scales", {shape[0], shape[1], groups}, true));
      return GuardTorch([&]() -> absl::StatusOr<at::Tensor> {
        if (blocks.scalar_type() != at::kByte || scales.scalar_type() != at::kByte) {
          return absl::InvalidArgumentError(absl::StrCat(name, "_blocks / _scales: MXFP4 tensors must be U8"));
        }
        at::Tensor dense = DequantizeMxfp4(blocks, scales, type);  // [E, out (interleaved), in]
        return GptOssFromStored(which, dense.transpose(1, 2));
      });
    }
    LORASTEP_ASSIGN_OR_RETURN(at::Tensor stored, load(name, GptOssStoredShape(which, shape)));
    return GuardTorch([&]() -> absl::StatusOr<at::Tensor> { return GptOssFromStored(which, stored); });
  };

  std::map<std::string, at::Tensor> loaded;
  for (const auto& [name, shape] : ExpectedTensorShapes(model.config)) {
    const GptOssExpertTensor gpt_oss =
        model.config.gpt_oss() ? GptOssExpertTensorOf(name) : GptOssExpertTensor::kNone;
    const bool experts = absl::EndsWith(name, "mlp.experts.gate_up_proj") ||
                         absl::EndsWith(name, "mlp.experts.down_proj");
    if (gpt_oss != GptOssExpertTensor::kNone) {
      LORASTEP_ASSIGN_OR_RETURN(loaded[name], load_gpt_oss(name, gpt_oss, shape));
      continue;
    }
    LORASTEP_ASSIGN_OR_RETURN(loaded[name], experts ? load_experts(name, shape) : load(name, shape));
  }
  if (model.config.language_model_of_vl) {
    LORASTEP_LOG(Info) << folder << ": loaded the text model of a vision-language folder ("
                       << model.config.model_type << "); its vision tower is not loaded";
  }
  model.weights = ModelSkeleton(model.config);
  ForEachNamedTensor(model.weights,
                     [&](const std::string& name, at::Tensor& t) { t = loaded.at(name); });
  return model;
}

absl::Status SaveModel(const std::string& folder, const ModelConfig& config,
                       const ModelWeights& weights, int shards) {
  LORASTEP_RETURN_IF_ERROR(MakeDirectories(folder));
  LORASTEP_RETURN_IF_ERROR(WriteStringToFile(folder + "/config.json", ModelConfigToJson(config)));
  // Routed experts go out as one module per expert, the layout save_pretrained writes and
  // Hub checkpoints use (LoadModel reads it and the stacked one).
  std::vector<std::pair<std::string, at::Tensor>> named;
  ForEachNamedTensor(weights, [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    if (config.gpt_oss()) {  // gpt-oss's own stacked layout
      const GptOssExpertTensor which = GptOssExpertTensorOf(name);
      named.emplace_back(name, which == GptOssExpertTensor::kNone ? t : GptOssToStored(which, t));
      return;
    }
    const bool gate_up = absl::EndsWith(name, "mlp.experts.gate_up_proj");
    if (!gate_up && !absl::EndsWith(name, "mlp.experts.down_proj")) {
      named.emplace_back(name, t);
      return;
    }
    const std::string base = name.substr(0, name.rfind('.'));
    for (int64_t e = 0; e < t.size(0); ++e) {
      const std::string prefix = absl::StrCat(base, ".", e, ".");
      if (gate_up) {
        const int64_t f = t.size(1) / 2;
        named.emplace_back(prefix + "gate_proj.weight", t[e].narrow(0, 0, f).contiguous());
        named.emplace_back(prefix + "up_proj.weight", t[e].narrow(0, f, f).contiguous());
      } else {
        named.emplace_back(prefix + "down_proj.weight", t[e].contiguous());
      }
    }
  });
  if (shards <= 1) {
    TensorWriteList list;
    for (const auto& [name, t] : named) LORASTEP_RETURN_IF_ERROR(list.Add(name, t));
    return list.WriteTo(folder + "/model.safetensors", {{"format", "pt"}});
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", 0}};
  int64_t total = 0;
  const size_t per_shard = (named.size() + shards - 1) / shards;
  for (int s = 0; s < shards; ++s) {
    const std::string file =
        absl::StrCat("model-", absl::Dec(s + 1, absl::kZeroPad5), "-of-",
                     absl::Dec(shards, absl::kZeroPad5), ".safetensors");
    TensorWriteList list;
    for (size_t i = s * per_shard; i < std::min(named.size(), (s + 1) * per_shard); ++i) {
      LORASTEP_RETURN_IF_ERROR(list.Add(named[i].first, named[i].second));
      index["weight_map"][named[i].first] = file;
      total += named[i].second.numel() * named[i].second.element_size();
    }
    LORASTEP_RETURN_IF_ERROR(list.WriteTo(folder + "/" + file, {{"format", "pt"}}));
  }
  index["metadata"]["total_size"] = total;
  return WriteStringToFile(folder + "/model.safetensors.index.json", index.dump(2) + "\n");
}

void PackProjections(ModelWeights* weights, int64_t spare_columns) {
  auto pack = [](std::initializer_list<at::Tensor*> members, int64_t spare) {
    std::vector<at::Tensor> parts;
    int64_t rows = 0;
    for (const at::Tensor* t : members) {
      if (!t->defined()) return;
      parts.push_back(*t);
      rows += t->size(0);
    }
    if (spare > 0 && parts[0].dim() != 2) spare = 0;
    at::Tensor packed;
    if (spare == 0) {
      packed = at::cat(parts, 0);
    } else {  // each row `spare` columns wider than the weights; the spare columns zero
      const int64_t in = parts[0].size(1);
      packed = at::empty({rows, in + spare}, parts[0].options());
      packed.narrow(1, in, spare).zero_();
      packed = packed.narrow(1, 0, in);
    }
    int64_t row = 0;
    for (at::Tensor* t : members) {
      const int64_t n = t->size(0);
      at::Tensor slot = packed.narrow(0, row, n);
      if (spare > 0) slot.copy_(*t);
      *t = slot;
      row += n;
    }
  };
  for (LayerWeights& l : weights->layers) {
    pack({&l.linear[kQProj], &l.linear[kKProj], &l.linear[kVProj]}, 0);
    pack({&l.qkv_bias[0], &l.qkv_bias[1], &l.qkv_bias[2]}, 0);
    pack({&l.linear[kGateProj], &l.linear[kUpProj]}, spare_columns);
  }
}

ModelWeights RandomModelWeights(const ModelConfig& config, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::ScalarType type = ScalarTypeFromName(config.torch_dtype).value_or(at::kFloat);
  ModelWeights w = ModelSkeleton(config);
  ForEachNamedTensor(w, [&](const std::string& name, at::Tensor& t) {
    at::Tensor f = at::empty(t.sizes(), at::kFloat);
    if (name.find("norm") != std::string::npos) {
      // Near 1, but not exactly (tests see the norm weights); zero-centered norms store w - 1.
      const bool offset = config.zero_centered_norm() && name.find("linear_attn.norm") == std::string::npos;
      f.normal_(offset ? 0.0 : 1.0, 0.1, gen);
    } else {
      f.normal_(0.0, 0.02, gen);  // matrices and biases alike
    }
    t = f.to(type);
  });
  return w;
}

at::Tensor CutLinearSplit(const at::Tensor& whole, const LinearSplit& split, int tp, int tp_rank) {
  if (split.groups.empty()) return whole.narrow(split.dim, split.begin, split.end - split.begin);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t size : split.groups) {
    const auto [begin, end] = EvenRange(size, tp, tp_rank);
    parts.push_back(whole.narrow(split.dim, start + begin, end - begin));
    start += size;
  }
  return at::cat(parts, split.dim);
}

at::Tensor JoinGroupedSplit(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& groups, int dim) {
  const int tp = static_cast<int>(parts.size());
  std::vector<at::Tensor> pieces;
  std::vector<int64_t> offset(tp, 0);  // where each rank's next group starts in its part
  for (int64_t size : groups) {
    for (int r = 0; r < tp; ++r) {
      const auto [begin, end] = EvenRange(size, tp, r);
      pieces.push_back(parts[r].narrow(dim, offset[r], end - begin));
      offset[r] += end - begin;
    }
  }
  return at::cat(pieces, dim);
}

ModelWeights ShardModelWeights(const ModelWeights& full, const ModelConfig& config,
                               const ModelShard& shard) {
  if (shard.whole()) return full;
  auto cut = [](const at::Tensor& t, int dim, int64_t begin, int64_t end) {
    return t.narrow(dim, begin, end - begin).clone();
  };
  ModelWeights out;
  out.first_layer = shard.layer_begin;
  out.embed_tokens = cut(full.embed_tokens, 0, shard.vocab_begin, shard.vocab_end);
  if (full.lm_head.defined()) out.lm_head = cut(full.lm_head, 0, shard.vocab_begin, shard.vocab_end);
  out.final_norm = full.final_norm;
  for (int64_t layer = shard.layer_begin; layer < shard.layer_end; ++layer) {
    const LayerWeights& src = full.layers[layer];
    LayerWeights dst;
    dst.layout = src.layout;
    dst.input_norm = src.input_norm;
    dst.post_attention_norm = src.post_attention_norm;
    dst.q_norm = src.q_norm;
    dst.k_norm = src.k_norm;
    dst.o_bias = src.o_bias;  // added once, after o_proj's all-reduce
    if (src.conv1d.defined()) {  // Gated DeltaNet: q/k/v channels as in_proj_qkv's rows, per-head tensors
      dst.conv1d = CutLinearSplit(src.conv1d, LinearSplitOf(shard, kInProjQkv, config), shard.tp, shard.tp_rank).clone();
      dst.a_log = cut(src.a_log, 0, shard.linear_value_head_begin, shard.linear_value_head_begin + shard.linear_value_heads);
      dst.dt_bias =
          cut(src.dt_bias, 0, shard.linear_value_head_begin, shard.linear_value_head_begin + shard.linear_value_heads);
      dst.linear_norm = src.linear_norm;  // over each value head's dimensions: whole
    }
    if (src.sinks.defined()) dst.sinks = cut(src.sinks, 0, shard.head_begin, shard.head_begin + shard.heads);
    for (int slot = 0; slot < kNumLinearSlots; ++slot) {
      if (!src.linear[slot].defined()) continue;  // no shared expert on this MoE layer
      const LinearSplit split = LinearSplitOf(shard, slot, config, src.layout.moe);
      dst.linear[slot] = CutLinearSplit(src.linear[slot], split, shard.tp, shard.tp_rank).clone();
      if (slot < 3 && src.qkv_bias[slot].defined()) {
        dst.qkv_bias[slot] = cut(src.qkv_bias[slot], 0, split.begin, split.end);
      }
    }
    if (src.layout.moe) {
      // This rank's experts; of each, its columns of the SwiGLU width (gate and up rows cut
      // alike, so gate rows still come first), and the matching columns of down.
      const int64_t f = config.moe.moe_intermediate_size;
      const int64_t eb = shard.expert_begin, ee = shard.expert_end;
      const int64_t fb = shard.moe_ffn_begin, fe = shard.moe_ffn_end;
      at::Tensor gate_up = src.experts_gate_up.narrow(0, eb, ee - eb);
      dst.experts_gate_up = at::cat({gate_up.narrow(1, fb, fe - fb), gate_up.narrow(1, f + fb, fe - fb)}, 1);
      dst.experts_down = cut(src.experts_down.narrow(0, eb, ee - eb), 2, fb, fe);
      dst.router = src.router;
      dst.router_bias = src.router_bias;
      dst.shared_expert_gate = src.shared_expert_gate;
      if (src.experts_gate_up_bias.defined()) {
        at::Tensor bias = src.experts_gate_up_bias.narrow(0, eb, ee - eb);
        dst.experts_gate_up_bias = at::cat({bias.narrow(1, fb, fe - fb), bias.narrow(1, f + fb, fe - fb)}, 1);
        dst.experts_down_bias = cut(src.experts_down_bias, 0, eb, ee);  // added by tensor rank 0 alone
      }
    }
    out.layers.push_back(std::move(dst));
  }
  return out;
}

}  // namespace lorastep
