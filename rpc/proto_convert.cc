#include "rpc/proto_convert.h"

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

absl::StatusOr<LossConfig> LossConfigFromProto(const v1::LossConfig& p) {
  LossConfig c;
  LORASTEP_ASSIGN_OR_RETURN(c.kind, ParseLossKind(p.loss_fn().empty() ? "cross_entropy" : p.loss_fn()));
  if (p.has_clip_eps_low()) c.clip_eps_low = p.clip_eps_low();
  if (p.has_clip_eps_high()) c.clip_eps_high = p.clip_eps_high();
  if (p.has_dual_clip_c()) c.dual_clip_c = p.dual_clip_c();
  if (p.has_cispo_ratio_low()) c.cispo_ratio_low = p.cispo_ratio_low();
  if (p.has_cispo_ratio_high()) c.cispo_ratio_high = p.cispo_ratio_high();
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
