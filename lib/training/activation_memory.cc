#include "lib/training/activation_memory.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "lib/torch_compat.h"

namespace lorastep {

namespace {

// tokens: rows the layers see; attention_pairs: sum over sequences of length^2; rule_rows:
// rows of the Gated DeltaNet rule's batch (packed sequences padded to the longest).
double ActivationBytes(const ModelConfig& c, const ModelShard& shard, double tokens, double attention_pairs,
                       double rule_rows, bool backward, int64_t element_bytes, int64_t logprob_chunk_tokens,
                       LayerRecompute recompute, bool mlp_activation_kept, bool rule_kept) {
  const int64_t tp = std::max(1, shard.tp);
  const double layers = shard.layer_end > shard.layer_begin ? static_cast<double>(shard.layer_end - shard.layer_begin)
                                                            : static_cast<double>(c.num_hidden_layers);
  const double heads = static_cast<double>(shard.heads > 0 ? shard.heads : c.num_attention_heads);
  const double kv = static_cast<double>(shard.kv_heads > 0 ? shard.kv_heads : c.num_key_value_heads);
  const double d = static_cast<double>(c.head_dim()), h = static_cast<double>(c.hidden_size);
  double inner = static_cast<double>(c.intermediate_size) / tp;
  if (c.is_moe()) {  // each token's routed experts, and the shared expert
    inner = std::max(inner, (static_cast<double>(c.moe.num_experts_per_tok * c.moe.moe_intermediate_size) +
                             static_cast<double>(c.moe.shared_expert_intermediate_size)) / tp);
  }
  const double mlp_rows = mlp_activation_kept || c.is_moe() ? 3.0 : 2.0;
  const double per_token_layer = (8.0 * h + mlp_rows * inner + 4.0 * kv * d) * static_cast<double>(element_bytes);
  double attention_scores = 0;  // the unfused attention of LibTorch < 2 materializes them
#if !LORASTEP_TORCH_AT_LEAST(2, 0)
  attention_scores = 3.0 * heads * attention_pairs * 4.0;
#else
  (void)attention_pairs;
#endif
  // Gated DeltaNet layers keep more than attention ones: the convolution's input and output,
  // z, the gates, the rule's output and the gated norm's fp32 operands; the chunked rule's own
  // intermediates (fp32: ~10 key-, 6 value- and 5 chunk-sized rows per value head and token,
  // and each chunk's state) exist for one layer at a time, as its backward runs it again.
  const LinearAttentionConfig& la = c.linear_attention;
  double linear_layers = 0;
  const int64_t first = shard.layer_end > shard.layer_begin ? shard.layer_begin : 0;
  const int64_t last = shard.layer_end > shard.layer_begin ? shard.layer_end : c.num_hidden_layers;
  for (int64_t i = first; i < last; ++i) linear_layers += c.IsLinearAttentionLayer(i) ? 1.0 : 0.0;
  double linear_extra = 0, rule_transient = 0, rule_saved = 0;
  // On context ranks the convolution and the rule run over the whole row (every rank's tokens).
  const double cp = static_cast<double>(std::max(1, shard.cp));
  if (linear_layers > 0) {
    const double value_heads = static_cast<double>(la.num_value_heads) / tp;
    const double conv = static_cast<double>(la.conv_dim()) / tp, value = static_cast<double>(la.value_dim()) / tp;
    const double dk = static_cast<double>(la.key_head_dim), dv = static_cast<double>(la.value_head_dim), chunk = 64;
    linear_extra = (2.0 * conv + 3.0 * value + 2.0 * value_heads) * static_cast<double>(element_bytes) +
                   (3.0 * value + 2.0 * value_heads) * 4.0;
    // Per token of this rank; the gathered row's convolution input and output, gates and rule
    // output add (cp - 1) times theirs.
    linear_extra += (cp - 1.0) * (2.0 * conv + value + 2.0 * value_heads) * static_cast<double>(element_bytes);
    rule_transient = rule_rows * cp * value_heads * (10.0 * dk + 6.0 * dv + 5.0 * chunk + dk * dv / chunk) * 4.0;
    // What the chunked rule keeps for backward when it is not run again (fp32 per row and value
    // head: its operands, the chunk system and its inverse and solution, each chunk's state).
    rule_saved = rule_rows * cp * value_heads * (3.0 * dk + 3.0 * dv + 5.0 * chunk + dk * dv / chunk + 3.0) * 4.0;
  }
  const double per_layer = tokens * per_token_layer + attention_scores + rule_transient;
  const double head = std::min(static_cast<double>(logprob_chunk_tokens), tokens) *
                      static_cast<double>(c.vocab_size) / tp * (static_cast<double>(element_bytes) + 12.0);
  if (backward && recompute != LayerRecompute::kNone) {  // every layer's input, plus one layer replayed at a time
    double kept = h * static_cast<double>(element_bytes);
    if (recompute == LayerRecompute::kSelective) kept += heads * d * static_cast<double>(element_bytes) + heads * 4.0;
    return layers * tokens * kept + per_layer + tokens * linear_extra + head;
  }
  if (!backward) return per_layer + tokens * linear_extra + head;
  return layers * (tokens * per_token_layer + attention_scores) + linear_layers * tokens * linear_extra +
         rule_transient + (rule_kept ? linear_layers * rule_saved : 0.0) + head;
}

}  // namespace

double EstimateActivationBytes(const ModelConfig& c, const ModelShard& shard, int64_t b, int64_t s,
                               bool backward, int64_t element_bytes, int64_t logprob_chunk_tokens, LayerRecompute recompute,
                               bool mlp_activation_kept, bool rule_kept) {
  const double tokens = static_cast<double>(b) * static_cast<double>(s);
  return ActivationBytes(c, shard, tokens, tokens * static_cast<double>(s), tokens, backward, element_bytes,
                         logprob_chunk_tokens, recompute, mlp_activation_kept, rule_kept);
}

double EstimatePackedActivationBytes(const ModelConfig& c, const ModelShard& shard,
                                     const std::vector<int64_t>& lengths, bool backward, int64_t element_bytes,
                                     int64_t logprob_chunk_tokens, LayerRecompute recompute, bool mlp_activation_kept,
                                     bool rule_kept) {
  double tokens = 0, pairs = 0, longest = 0;
  for (int64_t n : lengths) {
    tokens += static_cast<double>(n);
    pairs += static_cast<double>(n) * static_cast<double>(n);
    longest = std::max(longest, static_cast<double>(n));
  }
  const double rule_rows = longest * static_cast<double>(lengths.size());
  return ActivationBytes(c, shard, tokens, pairs, rule_rows, backward, element_bytes, logprob_chunk_tokens, recompute,
                         mlp_activation_kept, rule_kept);
}

int64_t AvailableHostMemoryBytes() {
  int64_t available = -1;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      long long kb = 0;
      if (std::sscanf(line, "MemAvailable: %lld kB", &kb) == 1) available = static_cast<int64_t>(kb) * 1024;
    }
    std::fclose(f);
  }
  // The cgroup limits (containers, systemd services) cap what this process may take.
  std::string own_cgroup;
  if (std::FILE* f = std::fopen("/proc/self/cgroup", "r")) {
    char line[4096];
    while (std::fgets(line, sizeof(line), f) != nullptr) own_cgroup += line;
    std::fclose(f);
  }
  const int64_t room = CgroupMemoryRoom(own_cgroup);
  if (room >= 0) available = available < 0 ? room : std::min(available, room);
  return available;
}

int64_t CgroupMemoryRoom(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  auto read_number = [](const std::string& path) -> int64_t {
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) return -1;
    long long v = -1;
    const int n = std::fscanf(f, "%lld", &v);
    std::fclose(f);
    return n == 1 ? static_cast<int64_t>(v) : -1;  // "max" reads as no number
  };
  int64_t room = -1;
  // Walks from the cgroup folder `dir` up to `top`, keeping the least limit - usage.
  auto walk = [&](std::string dir, const std::string& top, const char* limit_file, const char* usage_file) {
    while (true) {
      const int64_t limit = read_number(dir + "/" + limit_file);
      const int64_t used = read_number(dir + "/" + usage_file);
      // cgroup v1 writes "no limit" as a page-rounded INT64_MAX.
      if (limit > 0 && limit < (int64_t{1} << 62) && used >= 0) {
        const int64_t left = std::max<int64_t>(0, limit - used);
        room = room < 0 ? left : std::min(room, left);
      }
      if (dir.size() <= top.size()) break;
      dir = dir.substr(0, dir.rfind('/'));
    }
  };
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    // "hierarchy-id:controllers:path"; v2 is "0::/path".
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3 || parts[2].empty() || parts[2].front() != '/') continue;
    std::string path(parts[2]);
    while (!path.empty() && path.back() == '/') path.pop_back();
    if (parts[0] == "0" && parts[1].empty()) {
      walk(cgroup_root + path, cgroup_root, "memory.max", "memory.current");
    } else if (absl::StrContains(parts[1], "memory")) {
      const std::string top = cgroup_root + "/memory";
      walk(top + path, top, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
  }
  return room;
}

}  // namespace lorastep
