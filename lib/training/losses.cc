#include "lib/training/losses.h"

namespace lorastep {
namespace {

// Masked mean over loss-bearing positions, as a (sum, count) partial.
void AddMaskedMean(PendingMetrics* metrics, const std::string& name, const at::Tensor& values,
                   const at::Tensor& bearing) {
  metrics->Add(name, (values.detach().to(at::kDouble) * bearing).sum(), bearing.sum());
}

// KL(pi || ref) estimators on r = ref - lp (Schulman's k1/k2/k3; k3 = low_var_kl, clamped).
at::Tensor KlPenalty(KlEstimator estimator, const at::Tensor& lp, const at::Tensor& ref) {
  at::Tensor r = ref - lp;
  switch (estimator) {
    case KlEstimator::kK1: return -r;
    case KlEstimator::kK2: return r.pow(2) * 0.5;
    case KlEstimator::kK3: {
      at::Tensor rc = r.clamp(-10.0, 10.0);
      return (at::exp(rc) - rc - 1.0).clamp(-10.0, 10.0);
    }
  }
  return r;
}

}  // namespace

void PendingMetrics::Add(const std::string& name, const at::Tensor& sum, const at::Tensor& count) {
  names_.push_back(name);
  values_.push_back(at::stack({sum.detach().to(at::kDouble).reshape({}), count.detach().to(at::kDouble).reshape({})}));
}

void PendingMetrics::Add(const std::string& name, const at::Tensor& sum) {
  Add(name, sum, at::ones({}, sum.options().dtype(at::kDouble)));
}

void PendingMetrics::Resolve(Metrics* metrics) {
  if (values_.empty()) return;
  at::Tensor all = at::stack(values_).to(at::kCPU);  // the one synchronization
  const double* v = all.data_ptr<double>();
  for (size_t i = 0; i < names_.size(); ++i) metrics->Add(names_[i], v[2 * i], v[2 * i + 1]);
  names_.clear();
  values_.clear();
}

at::Tensor ComputeLoss(const LossConfig& c, const LossInputs& in, const LossDenominators& den,
                       Metrics* metrics) {
  PendingMetrics pending;
  at::Tensor loss = ComputeLoss(c, in, den, &pending);
  pending.Resolve(metrics);
  return loss;
}

at::Tensor ComputeLoss(const LossConfig& c, const LossInputs& in, const LossDenominators& den,
                       PendingMetrics* metrics) {
  const at::Tensor& lp = in.logprobs;
  at::Tensor bearing = (in.mask != 0).to(at::kDouble);
  at::Tensor old = in.old_logprobs.defined() ? in.old_logprobs : in.sampler_logprobs;
  at::Tensor pg;  // per-position policy loss
  switch (c.kind) {
    case LossKind::kCrossEntropy:
      pg = -lp;
      break;
    case LossKind::kImportanceSampling:
      pg = -(at::exp(lp - old) * in.advantages);
      break;
    case LossKind::kPpo: {
      at::Tensor ratio = at::exp(lp - old);
      at::Tensor surr1 = -ratio * in.advantages;
      at::Tensor surr2 = -ratio.clamp(1.0 - c.clip_eps_low, 1.0 + c.clip_eps_high) * in.advantages;
      pg = at::max(surr1, surr2);
      AddMaskedMean(metrics, "pg_clipfrac:mean", (surr2 > surr1).to(at::kFloat), bearing);
      if (c.dual_clip_c > 0) {
        at::Tensor bound = -c.dual_clip_c * in.advantages;
        at::Tensor negative = in.advantages < 0;
        AddMaskedMean(metrics, "pg_clipfrac_lower:mean",
                      (negative & (pg > bound)).to(at::kFloat), bearing);
        pg = at::where(negative, at::min(pg, bound), pg);
      }
      AddMaskedMean(metrics, "ppo_kl:mean", old - lp, bearing);
      break;
    }
    case LossKind::kCispo: {
      at::Tensor ratio = at::exp(lp - old).detach();
      at::Tensor weight = ratio.clamp(c.cispo_ratio_low, c.cispo_ratio_high);
      AddMaskedMean(metrics, "pg_clipfrac:mean", (weight != ratio).to(at::kFloat), bearing);
      pg = -(weight * lp * in.advantages);
      break;
    }
  }
  if (c.tis_cap > 0) {
    // Truncated importance sampling corrects the trainer/sampler mismatch:
    // w = clamp(exp(trainer_old - sampler), 0, C), no gradient through w.
    at::Tensor trainer_old = in.old_logprobs.defined() ? in.old_logprobs : lp.detach();
    at::Tensor raw = at::exp(trainer_old - in.sampler_logprobs);
    at::Tensor w = raw.clamp(0.0, c.tis_cap);
    AddMaskedMean(metrics, "tis:mean", w, bearing);
    AddMaskedMean(metrics, "tis_clipfrac:mean", (raw > c.tis_cap).to(at::kFloat), bearing);
    pg = pg * w;
  }
  at::Tensor total = pg;
  if (in.ref_logprobs.defined()) {
    at::Tensor kl = KlPenalty(c.kl_estimator, lp, in.ref_logprobs);
    AddMaskedMean(metrics, "kl_ref:mean", kl, bearing);
    if (c.kl_coef > 0) total = total + c.kl_coef * kl;
  }
  if (c.entropy_coef != 0) total = total - c.entropy_coef * in.entropy;
  AddMaskedMean(metrics, "entropy:mean", in.entropy, bearing);
  if (in.sampler_logprobs.defined()) {
    at::Tensor diff = lp.detach() - in.sampler_logprobs;
    AddMaskedMean(metrics, "train_rollout_logprob_abs_diff:mean", diff.abs(), bearing);
    AddMaskedMean(metrics, "train_rollout_kl:mean", KlPenalty(KlEstimator::kK3, lp.detach(),
                                                              in.sampler_logprobs), bearing);
  }

  // Per-position normalizer so that micro-batch losses sum to the batch loss.
  at::Tensor scale;
  switch (c.normalization) {
    case LossNormalization::kToken:
      scale = in.mask / std::max(den.loss_tokens, 1.0);
      break;
    case LossNormalization::kSequence:
      scale = in.mask / (den.sample_tokens.index_select(0, in.sample_index).clamp_min(1.0) *
                         std::max(den.samples, 1.0));
      break;
    case LossNormalization::kSum:
      scale = in.mask;
      break;
  }
  at::Tensor loss = (total * scale).sum();
  metrics->Add("loss:sum", loss);
  metrics->Add("pg_loss:sum", (pg.detach() * scale).sum());
  return loss;
}

}  // namespace lorastep
