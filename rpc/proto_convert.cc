#include "rpc/proto_convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include "lib/status_macros.h"

namespace lorastep {
namespace {

template <typename T, typename R>
std::vector<T> ToVector(const R& repeated) {
  return std::vector<T>(repeated.begin(), repeated.end());
}

}  // namespace

std::vector<Datum> DatumsFromProto(const google::protobuf::RepeatedPtrField<v1::Datum>& datums) {
  std::vector<Datum> out;
  out.reserve(datums.size());
  for (const v1::Datum& d : datums) {
    Datum datum;
    datum.tokens = ToVector<int64_t>(d.tokens());
    datum.target_tokens = ToVector<int64_t>(d.target_tokens());
    datum.weights = ToVector<float>(d.weights());
    datum.logprobs = ToVector<float>(d.logprobs());
    datum.advantages = ToVector<float>(d.advantages());
    datum.ref_logprobs = ToVector<float>(d.ref_logprobs());
    datum.old_logprobs = ToVector<float>(d.old_logprobs());
    out.push_back(std::move(datum));
  }
  return out;
}

namespace {

constexpr char kPacked[] = "packed_datums";

// Sets `out` to the `n` 4-byte values of type `Wire` from `bytes` at element `offset`
// (leaves it empty when `bytes` is: an absent optional field).
template <typename Wire, typename T>
void UnpackInto(absl::string_view bytes, int64_t offset, int64_t n, std::vector<T>* out) {
  if (bytes.empty()) return;
  out->resize(static_cast<size_t>(n));
  const char* from = bytes.data() + offset * 4;
  if constexpr (std::is_same_v<Wire, T>) {
    std::memcpy(out->data(), from, static_cast<size_t>(n) * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      Wire value;
      std::memcpy(&value, from + 4 * i, 4);
      (*out)[static_cast<size_t>(i)] = value;
    }
  }
}

}  // namespace

bool PackedArrays::empty() const {
  return lengths.empty() && tokens.empty() && target_tokens.empty() && weights.empty() && logprobs.empty() &&
         advantages.empty() && ref_logprobs.empty() && old_logprobs.empty() && last_target_tokens.empty();
}

PackedArrays ArraysOf(const v1::PackedDatums& packed) {
  PackedArrays arrays;
  arrays.lengths.assign(packed.lengths().begin(), packed.lengths().end());
  arrays.tokens = packed.tokens();
  arrays.target_tokens = packed.target_tokens();
  arrays.weights = packed.weights();
  arrays.logprobs = packed.logprobs();
  arrays.advantages = packed.advantages();
  arrays.ref_logprobs = packed.ref_logprobs();
  arrays.old_logprobs = packed.old_logprobs();
  arrays.last_target_tokens = packed.last_target_tokens();
  return arrays;
}

absl::StatusOr<PackedLayout> CheckPackedArrays(const PackedArrays& packed) {
  static_assert(sizeof(float) == 4, "packed float32");
  PackedLayout layout;
  layout.offsets.reserve(packed.lengths.size() + 1);
  int64_t total = 0;
  for (size_t i = 0; i < packed.lengths.size(); ++i) {
    if (packed.lengths[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(kPacked, ".lengths[", i, "]: ", packed.lengths[i], " is negative"));
    }
    layout.offsets.push_back(total);
    total += packed.lengths[i];
  }
  layout.offsets.push_back(total);
  layout.next_token_targets = !packed.last_target_tokens.empty();
  if (layout.next_token_targets) {
    if (!packed.target_tokens.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kPacked, ".last_target_tokens: set together with target_tokens; send one"));
    }
    const int64_t expected = 4 * static_cast<int64_t>(packed.lengths.size());
    if (static_cast<int64_t>(packed.last_target_tokens.size()) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(kPacked, ".last_target_tokens: ", packed.last_target_tokens.size(),
                                                     " bytes; expected 4 per datum, ", expected, " for the ",
                                                     packed.lengths.size(), " datums in lengths"));
    }
  }
  const std::tuple<const char*, const absl::string_view*, bool> arrays[] = {
      {"tokens", &packed.tokens, true},          {"target_tokens", &packed.target_tokens, !layout.next_token_targets},
      {"weights", &packed.weights, false},       {"logprobs", &packed.logprobs, false},
      {"advantages", &packed.advantages, false}, {"ref_logprobs", &packed.ref_logprobs, false},
      {"old_logprobs", &packed.old_logprobs, false}};
  for (const auto& [name, bytes, required] : arrays) {
    if (static_cast<int64_t>(bytes->size()) == 4 * total || (!required && bytes->empty())) continue;
    return absl::InvalidArgumentError(absl::StrCat(kPacked, ".", name, ": ", bytes->size(), " bytes; expected 4 per position, ",
                                                   4 * total, " for the ", total, " positions in lengths",
                                                   required ? "" : " (or none)"));
  }
  return layout;
}

void UnpackDatums(const PackedArrays& packed, const PackedLayout& layout, size_t begin, size_t end,
                  std::vector<Datum>* out) {
  for (size_t i = begin; i < end; ++i) {
    const int64_t offset = layout.offsets[i];
    const int64_t n = layout.offsets[i + 1] - offset;
    Datum& d = (*out)[i];
    UnpackInto<int32_t>(packed.tokens, offset, n, &d.tokens);
    if (layout.next_token_targets) {
      d.target_tokens.resize(static_cast<size_t>(n));
      if (n > 0) {
        std::copy(d.tokens.begin() + 1, d.tokens.end(), d.target_tokens.begin());
        int32_t last;
        std::memcpy(&last, packed.last_target_tokens.data() + 4 * i, 4);
        d.target_tokens[static_cast<size_t>(n - 1)] = last;
      }
    } else {
      UnpackInto<int32_t>(packed.target_tokens, offset, n, &d.target_tokens);
    }
    UnpackInto<float>(packed.weights, offset, n, &d.weights);
    UnpackInto<float>(packed.logprobs, offset, n, &d.logprobs);
    UnpackInto<float>(packed.advantages, offset, n, &d.advantages);
    UnpackInto<float>(packed.ref_logprobs, offset, n, &d.ref_logprobs);
    UnpackInto<float>(packed.old_logprobs, offset, n, &d.old_logprobs);
  }
}

absl::StatusOr<std::vector<Datum>> RequestDatums(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                                 const PackedArrays& packed) {
  if (packed.empty()) return DatumsFromProto(datums);
  if (!datums.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(kPacked, ": set together with datums; send one form"));
  }
  absl::StatusOr<PackedLayout> layout = CheckPackedArrays(packed);
  if (!layout.ok()) return layout.status();
  std::vector<Datum> out(packed.lengths.size());
  UnpackDatums(packed, *layout, 0, out.size(), &out);
  return out;
}

absl::StatusOr<std::vector<Datum>> RequestDatums(const google::protobuf::RepeatedPtrField<v1::Datum>& datums,
                                                 const v1::PackedDatums& packed) {
  if (packed.ByteSizeLong() == 0) return DatumsFromProto(datums);
  return RequestDatums(datums, ArraysOf(packed));
}

namespace {

// One datum's arrays, from either representation.
struct DatumView {
  template <typename Ints, typename Floats>
  DatumView(const Ints& tokens, const Ints& targets, std::initializer_list<const Floats*> optional)
      : tokens(tokens.data()), targets(targets.data()), n(tokens.size()), targets_n(targets.size()) {
    size_t k = 0;
    for (const Floats* f : optional) floats[k++] = {f->data(), static_cast<size_t>(f->size())};
  }
  const int64_t* tokens;
  const int64_t* targets;
  size_t n, targets_n;
  std::pair<const float*, size_t> floats[5];  // weights, logprobs, advantages, ref_, old_logprobs
};

DatumView ViewOf(const Datum& d) {
  return DatumView(d.tokens, d.target_tokens,
                   {&d.weights, &d.logprobs, &d.advantages, &d.ref_logprobs, &d.old_logprobs});
}
DatumView ViewOf(const v1::Datum& d) {
  return DatumView(d.tokens(), d.target_tokens(),
                   {&d.weights(), &d.logprobs(), &d.advantages(), &d.ref_logprobs(), &d.old_logprobs()});
}

// Narrows `n` token ids to int32 and appends them to `out`, through a small buffer that stays
// in L1; false when one does not fit. `shifted` (may be null) is and-ed with whether
// targets[j] == ids[j + 1] for each j < n - 1, checked chunk by chunk while the ids are in L1.
bool AppendNarrowed(const int64_t* ids, size_t n, const int64_t* targets, bool* shifted, std::string* out) {
  constexpr size_t kChunk = 1024;
  int32_t narrowed[kChunk];
  for (size_t start = 0; start < n; start += kChunk) {
    const size_t m = std::min(kChunk, n - start);
    bool fits = true;
    for (size_t i = 0; i < m; ++i) {
      const int64_t id = ids[start + i];
      narrowed[i] = static_cast<int32_t>(id);
      fits &= narrowed[i] == id;
    }
    if (!fits) return false;
    if (shifted != nullptr && *shifted) {
      const size_t end = std::min(start + m, n - 1);
      bool same = true;
      for (size_t j = start; j < end; ++j) same &= targets[j] == ids[j + 1];
      *shifted = same;
    }
    out->append(reinterpret_cast<const char*>(narrowed), m * 4);
  }
  return true;
}

// Packs `views` into `out`, whose arrays keep their buffers (a caller that packs every step
// into the same message allocates them once: a fresh 128 KB array is mapped and faulted in
// page by page); false (and `out` empty) when the packed form cannot say the same: an
// optional field on some datums only, an array of another length than its tokens, or a
// token id outside int32. One pass over the data: floats appended as they are, token ids
// narrowed and range-checked together, and next-token targets (each datum's targets its
// tokens shifted by one, sent as one last target per datum) recognized on the way; a batch
// whose targets are not those takes a second pass for them.
bool PackViews(const std::vector<DatumView>& views, v1::PackedDatums* out) {
  out->Clear();  // keeps the arrays' buffers
  for (int f = 0; f < 5; ++f) {
    size_t with = 0;
    for (const DatumView& v : views) {
      if (v.floats[f].second != 0 && v.floats[f].second != v.n) return false;
      with += v.floats[f].second != 0 ? 1 : 0;
    }
    if (with != 0 && with != views.size()) return false;
  }
  size_t total = 0;
  bool next_token_targets = !views.empty();  // until a datum shows otherwise
  for (const DatumView& v : views) {
    if (v.targets_n != v.n || v.n > static_cast<size_t>(INT32_MAX)) return false;
    total += v.n;
    next_token_targets = next_token_targets && v.n > 0;
  }
  v1::PackedDatums& packed = *out;
  std::string* float_fields[] = {packed.mutable_weights(), packed.mutable_logprobs(), packed.mutable_advantages(),
                                 packed.mutable_ref_logprobs(), packed.mutable_old_logprobs()};
  bool has_float[5];  // all datums have the field, or none (checked above)
  for (int f = 0; f < 5; ++f) {
    has_float[f] = !views.empty() && views[0].floats[f].second != 0;
    if (has_float[f]) float_fields[f]->reserve(total * 4);
  }
  packed.mutable_tokens()->reserve(total * 4);
  if (next_token_targets) packed.mutable_last_target_tokens()->reserve(views.size() * 4);
  packed.mutable_lengths()->Reserve(static_cast<int>(views.size()));
  for (const DatumView& v : views) {
    packed.add_lengths(static_cast<int32_t>(v.n));
    bool ok = AppendNarrowed(v.tokens, v.n, v.targets, next_token_targets ? &next_token_targets : nullptr,
                             packed.mutable_tokens());
    if (ok && next_token_targets) ok = AppendNarrowed(v.targets + v.n - 1, 1, nullptr, nullptr, packed.mutable_last_target_tokens());
    if (!ok) {
      out->Clear();
      return false;
    }
    for (int f = 0; f < 5; ++f) {
      if (has_float[f]) float_fields[f]->append(reinterpret_cast<const char*>(v.floats[f].first), v.n * 4);
    }
  }
  if (!next_token_targets) {  // the targets as an array of their own
    packed.clear_last_target_tokens();
    std::string* targets = packed.mutable_target_tokens();
    targets->reserve(total * 4);
    for (const DatumView& v : views) {
      if (!AppendNarrowed(v.targets, v.n, nullptr, nullptr, targets)) {
        out->Clear();
        return false;
      }
    }
  }
  return true;
}

}  // namespace

void SetRequestDatums(const std::vector<Datum>& datums, const std::vector<int>& indices,
                      google::protobuf::RepeatedPtrField<v1::Datum>* as_datums, v1::PackedDatums* packed) {
  std::vector<DatumView> views;
  for (int i : indices) views.push_back(ViewOf(datums[i]));
  if (PackViews(views, packed)) return;
  for (int i : indices) {
    const Datum& d = datums[i];
    v1::Datum* out = as_datums->Add();
    out->mutable_tokens()->Add(d.tokens.begin(), d.tokens.end());
    out->mutable_target_tokens()->Add(d.target_tokens.begin(), d.target_tokens.end());
    out->mutable_weights()->Add(d.weights.begin(), d.weights.end());
    out->mutable_logprobs()->Add(d.logprobs.begin(), d.logprobs.end());
    out->mutable_advantages()->Add(d.advantages.begin(), d.advantages.end());
    out->mutable_ref_logprobs()->Add(d.ref_logprobs.begin(), d.ref_logprobs.end());
    out->mutable_old_logprobs()->Add(d.old_logprobs.begin(), d.old_logprobs.end());
  }
}

std::string LengthDelimitedHead(int field_number, size_t length) {
  using google::protobuf::internal::WireFormatLite;
  uint8_t head[10];  // a tag and a length, five bytes of varint each at most
  uint8_t* end = WireFormatLite::WriteTagToArray(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, head);
  end = google::protobuf::io::CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(length), end);
  return std::string(reinterpret_cast<const char*>(head), static_cast<size_t>(end - head));
}

PackedDatumsField::PackedDatumsField(int field_number, const v1::PackedDatums& packed) {
  using google::protobuf::FieldDescriptor;
  // Every field but `lengths` is a byte array (trainer.proto); `lengths` goes in the head.
  v1::PackedDatums small;
  *small.mutable_lengths() = packed.lengths();
  const std::string small_bytes = small.SerializeAsString();
  const google::protobuf::Descriptor* descriptor = v1::PackedDatums::descriptor();
  const google::protobuf::Reflection* reflection = v1::PackedDatums::GetReflection();
  array_headers_.reserve(static_cast<size_t>(descriptor->field_count()));
  size_t total = small_bytes.size();
  std::vector<absl::string_view> arrays;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->type() != FieldDescriptor::TYPE_BYTES || field->is_repeated()) continue;
    std::string scratch;
    const std::string& bytes = reflection->GetStringReference(packed, field, &scratch);
    if (bytes.empty()) continue;
    std::string header = LengthDelimitedHead(field->number(), bytes.size());
    total += header.size() + bytes.size();
    array_headers_.push_back(std::move(header));
    arrays.push_back(bytes);
  }
  head_ = LengthDelimitedHead(field_number, total) + small_bytes;
  for (size_t i = 0; i < arrays.size(); ++i) {
    pieces_.push_back(array_headers_[i]);
    pieces_.push_back(arrays[i]);
  }
}

bool PackDatums(const std::vector<v1::Datum>& datums, v1::PackedDatums* packed) {
  std::vector<DatumView> views;
  for (const v1::Datum& d : datums) views.push_back(ViewOf(d));
  return PackViews(views, packed);
}

absl::StatusOr<LossConfig> LossConfigFromProto(const v1::LossConfig& p) {
  LossConfig c;
  LORASTEP_ASSIGN_OR_RETURN(c.kind, ParseLossKind(p.loss_fn().empty() ? "cross_entropy" : p.loss_fn()));
  if (p.has_clip_eps_low()) c.clip_eps_low = p.clip_eps_low();
  if (p.has_clip_eps_high()) c.clip_eps_high = p.clip_eps_high();
  if (p.has_dual_clip_c()) c.dual_clip_c = p.dual_clip_c();
  if (p.has_cispo_ratio_low()) c.cispo_ratio_low = p.cispo_ratio_low();
  if (p.has_cispo_ratio_high()) c.cispo_ratio_high = p.cispo_ratio_high();
  if (p.has_dro_beta()) c.dro_beta = p.dro_beta();
  if (p.has_tis_cap()) c.tis_cap = p.tis_cap();
  if (p.has_kl_coef()) c.kl_coef = p.kl_coef();
  if (!p.kl_estimator().empty()) {
    LORASTEP_ASSIGN_OR_RETURN(c.kl_estimator, ParseKlEstimator(p.kl_estimator()));
  }
  if (p.has_entropy_coef()) c.entropy_coef = p.entropy_coef();
  if (!p.normalization().empty()) {
    LORASTEP_ASSIGN_OR_RETURN(c.normalization, ParseLossNormalization(p.normalization()));
  }
  LORASTEP_RETURN_IF_ERROR(ValidateLossConfig(c));
  return c;
}

absl::StatusOr<AdamWParams> AdamWParamsFromProto(const v1::AdamWParams& p) {
  AdamWParams f;
  if (p.has_lr()) f.lr = p.lr();
  if (p.has_beta1()) f.beta1 = p.beta1();
  if (p.has_beta2()) f.beta2 = p.beta2();
  if (p.has_eps()) f.eps = p.eps();
  if (p.has_weight_decay()) f.weight_decay = p.weight_decay();
  if (p.has_max_grad_norm()) f.max_grad_norm = p.max_grad_norm();
  if (p.has_min_lr_ratio()) f.min_lr_ratio = p.min_lr_ratio();
  LORASTEP_ASSIGN_OR_RETURN(f.schedule, ParseLrSchedule(p.schedule()));
  f.warmup_steps = p.warmup_steps();
  f.total_steps = p.total_steps();
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(f));
  return f;
}

absl::StatusOr<LoraConfig> LoraConfigFromProto(const v1::LoraConfig& p) {
  LoraConfig c;
  c.rank = p.rank();
  c.alpha = p.alpha();
  c.dropout = p.dropout();
  if (p.target_modules_size() > 0) c.target_modules = ToVector<std::string>(p.target_modules());
  if (p.has_train_attn() || p.has_train_mlp() || p.has_train_unembed()) {
    if (p.target_modules_size() > 0) {
      return absl::InvalidArgumentError(
          "lora.target_modules: give either target_modules or train_attn/train_mlp/train_unembed, not both");
    }
    LORASTEP_ASSIGN_OR_RETURN(
        c.target_modules,
        TargetsFromSwitches(!p.has_train_attn() || p.train_attn(), !p.has_train_mlp() || p.train_mlp(),
                            !p.has_train_unembed() || p.train_unembed()));
  }
  if (!p.expert_lora().empty()) c.expert_lora = p.expert_lora();
  return c;
}

void LoraConfigToProto(const LoraConfig& c, v1::LoraConfig* out) {
  out->set_rank(c.rank);
  out->set_alpha(c.alpha);
  out->set_dropout(c.dropout);
  out->clear_target_modules();
  for (const auto& m : c.target_modules) out->add_target_modules(m);
  out->set_expert_lora(c.expert_lora);
}

void MetricsToProto(const Metrics& metrics, google::protobuf::Map<std::string, double>* out) {
  for (const auto& [name, value] : metrics.Reduced()) (*out)[name] = value;
}

void MetricPartialsToProto(const Metrics& metrics,
                           google::protobuf::RepeatedPtrField<v1::MetricPartial>* out) {
  for (const auto& [name, a] : metrics.accumulators()) {
    v1::MetricPartial* p = out->Add();
    p->set_name(name);
    p->set_sum(a.sum);
    p->set_count(a.count);
    p->set_max(a.max);
  }
}

Metrics MetricsFromPartials(const google::protobuf::RepeatedPtrField<v1::MetricPartial>& partials) {
  Metrics m;
  for (const auto& p : partials) m.AddAccumulator(p.name(), {p.sum(), p.count(), p.max()});
  return m;
}

}  // namespace lorastep
