#include "lib/training/losses.h"

namespace lorastep {
namespace {

// Where a loss's per-position sums go: one run's PendingMetrics (sums over every position), or
// several runs' (runs own consecutive positions; `run_of` [N] names each position's run, and
// each metric is reduced for every run with one index_add).
class PositionSums {
 public:
  explicit PositionSums(PendingMetrics* metrics) : runs_{metrics} {}
  PositionSums(std::vector<PendingMetrics*> runs, at::Tensor run_of) : runs_(std::move(runs)), run_of_(std::move(run_of)) {}

  // Masked mean over loss-bearing positions, as a (sum, count) partial per run.
  void AddMaskedMean(const std::string& name, const at::Tensor& values, const at::Tensor& bearing) {
    const at::Tensor weighted = values.detach().to(at::kDouble) * bearing;
    if (!run_of_.defined()) {
      runs_.front()->Add(name, weighted.sum(), bearing.sum());
      return;
    }
    if (!bearing_counts_.defined() || !bearing.is_same(bearing_of_counts_)) {
      bearing_of_counts_ = bearing;
      bearing_counts_ = PerRun(bearing);
    }
    AddRows(name, at::stack({PerRun(weighted), bearing_counts_}, 1));
  }
  // A per-run sum (count 1), accumulated in fp64 either way: a loss sums terms of both signs,
  // and fp32 sums in different orders differ by more than 1e-6 of a small result.
  void AddSum(const std::string& name, const at::Tensor& values) {
    if (!run_of_.defined()) {
      runs_.front()->Add(name, values.detach().to(at::kDouble).sum());
      return;
    }
    const at::Tensor sums = PerRun(values.detach());
    AddRows(name, at::stack({sums, at::ones_like(sums)}, 1));
  }

 private:
  at::Tensor PerRun(const at::Tensor& values) const {
    return at::zeros({static_cast<int64_t>(runs_.size())}, values.options().dtype(at::kDouble))
        .index_add_(0, run_of_, values.to(at::kDouble));
  }
  void AddRows(const std::string& name, const at::Tensor& pairs) {
    for (size_t j = 0; j < runs_.size(); ++j) runs_[j]->AddPair(name, pairs[static_cast<int64_t>(j)]);
  }

  std::vector<PendingMetrics*> runs_;
  at::Tensor run_of_;
  at::Tensor bearing_of_counts_, bearing_counts_;
};

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

void PendingMetrics::AddPair(const std::string& name, const at::Tensor& pair) {
  names_.push_back(name);
  values_.push_back(pair);
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

namespace {

// The per-position loss terms of `in` and their metrics; `scale` normalizes each position
// (its run's denominators). Returns the sum of scale-weighted positions.
at::Tensor ScaledLoss(const LossConfig& c, const LossInputs& in, const at::Tensor& scale, PositionSums* metrics) {
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
      metrics->AddMaskedMean("pg_clipfrac:mean", (surr2 > surr1).to(at::kFloat), bearing);
      if (c.dual_clip_c > 0) {
        at::Tensor bound = -c.dual_clip_c * in.advantages;
        at::Tensor negative = in.advantages < 0;
        metrics->AddMaskedMean("pg_clipfrac_lower:mean", (negative & (pg > bound)).to(at::kFloat), bearing);
        pg = at::where(negative, at::min(pg, bound), pg);
      }
      metrics->AddMaskedMean("ppo_kl:mean", old - lp, bearing);
      break;
    }
    case LossKind::kCispo: {
      at::Tensor ratio = at::exp(lp - old).detach();
      at::Tensor weight = ratio.clamp(c.cispo_ratio_low, c.cispo_ratio_high);
      metrics->AddMaskedMean("pg_clipfrac:mean", (weight != ratio).to(at::kFloat), bearing);
      pg = -(weight * lp * in.advantages);
      break;
    }
    case LossKind::kDro: {
      // The advantage-weighted log-prob minus a quadratic penalty for moving off the
      // sampling policy: -(lp * A - beta / 2 * (lp - old)^2).
      const at::Tensor penalty = 0.5 * (lp - old).pow(2);
      metrics->AddMaskedMean("dro_penalty:mean", penalty.detach(), bearing);
      pg = -(lp * in.advantages - c.dro_beta * penalty);
      break;
    }
  }
  if (c.tis_cap > 0) {
    // Truncated importance sampling corrects the trainer/sampler mismatch:
    // w = clamp(exp(trainer_old - sampler), 0, C), no gradient through w.
    at::Tensor trainer_old = in.old_logprobs.defined() ? in.old_logprobs : lp.detach();
    at::Tensor raw = at::exp(trainer_old - in.sampler_logprobs);
    at::Tensor w = raw.clamp(0.0, c.tis_cap);
    metrics->AddMaskedMean("tis:mean", w, bearing);
    metrics->AddMaskedMean("tis_clipfrac:mean", (raw > c.tis_cap).to(at::kFloat), bearing);
    pg = pg * w;
  }
  at::Tensor total = pg;
  if (in.ref_logprobs.defined()) {
    at::Tensor kl = KlPenalty(c.kl_estimator, lp, in.ref_logprobs);
    metrics->AddMaskedMean("kl_ref:mean", kl, bearing);
    if (c.kl_coef > 0) total = total + c.kl_coef * kl;
  }
  if (c.entropy_coef != 0) total = total - c.entropy_coef * in.entropy;
  metrics->AddMaskedMean("entropy:mean", in.entropy, bearing);
  if (in.sampler_logprobs.defined()) {
    at::Tensor diff = lp.detach() - in.sampler_logprobs;
    metrics->AddMaskedMean("train_rollout_logprob_abs_diff:mean", diff.abs(), bearing);
    metrics->AddMaskedMean("train_rollout_kl:mean", KlPenalty(KlEstimator::kK3, lp.detach(), in.sampler_logprobs),
                           bearing);
  }
  const at::Tensor weighted = total * scale;
  metrics->AddSum("loss:sum", weighted);
  metrics->AddSum("pg_loss:sum", pg.detach() * scale);
  return weighted.sum();
}

// Per-position normalizer so that micro-batch losses sum to the batch loss.
at::Tensor PositionScale(const LossConfig& c, const LossInputs& in, const LossDenominators& den) {
  switch (c.normalization) {
    case LossNormalization::kToken:
      return in.mask / std::max(den.loss_tokens, 1.0);
    case LossNormalization::kSequence:
      return in.mask / (den.sample_tokens.index_select(0, in.sample_index).clamp_min(1.0) * std::max(den.samples, 1.0));
    case LossNormalization::kSum:
      return in.mask;
  }
  return in.mask;
}

at::Tensor CatDefined(const std::vector<LossInputs>& ins, at::Tensor LossInputs::*field) {
  if (!(ins.front().*field).defined()) return at::Tensor();
  std::vector<at::Tensor> parts;
  for (const LossInputs& in : ins) parts.push_back(in.*field);
  return at::cat(parts);
}

}  // namespace

at::Tensor ComputeLoss(const LossConfig& c, const LossInputs& in, const LossDenominators& den,
                       PendingMetrics* metrics) {
  PositionSums sums(metrics);
  return ScaledLoss(c, in, PositionScale(c, in, den), &sums);
}

bool SameLossInputsDefined(const LossInputs& a, const LossInputs& b) {
  return a.advantages.defined() == b.advantages.defined() &&
         a.sampler_logprobs.defined() == b.sampler_logprobs.defined() &&
         a.old_logprobs.defined() == b.old_logprobs.defined() && a.ref_logprobs.defined() == b.ref_logprobs.defined();
}

at::Tensor ComputeJointLoss(const LossConfig& c, const std::vector<LossInputs>& ins,
                            const std::vector<const LossDenominators*>& dens,
                            const std::vector<PendingMetrics*>& metrics) {
  TORCH_CHECK(!ins.empty() && ins.size() == dens.size() && ins.size() == metrics.size(),
              "ComputeJointLoss: one input, denominator and metrics per run");
  if (ins.size() == 1) return ComputeLoss(c, ins.front(), *dens.front(), metrics.front());
  for (const LossInputs& in : ins) {
    TORCH_CHECK(SameLossInputsDefined(in, ins.front()), "ComputeJointLoss: the runs' inputs differ in kind");
  }
  LossInputs joint;
  joint.logprobs = CatDefined(ins, &LossInputs::logprobs);
  joint.entropy = CatDefined(ins, &LossInputs::entropy);
  joint.mask = CatDefined(ins, &LossInputs::mask);
  joint.advantages = CatDefined(ins, &LossInputs::advantages);
  joint.sampler_logprobs = CatDefined(ins, &LossInputs::sampler_logprobs);
  joint.old_logprobs = CatDefined(ins, &LossInputs::old_logprobs);
  joint.ref_logprobs = CatDefined(ins, &LossInputs::ref_logprobs);
  // Each position's run, and its run's normalizer: per-run figures gathered per position.
  const auto device = joint.mask.device();
  std::vector<int64_t> lengths;
  std::vector<double> per_run;  // token: 1 / loss tokens; sequence: 1 / samples
  for (size_t j = 0; j < ins.size(); ++j) {
    lengths.push_back(ins[j].mask.size(0));
    per_run.push_back(1.0 / std::max(c.normalization == LossNormalization::kSequence ? dens[j]->samples
                                                                                          : dens[j]->loss_tokens,
                                      1.0));
  }
  const at::Tensor run_of = at::repeat_interleave(at::arange(static_cast<int64_t>(ins.size()), at::kLong),
                                                  at::tensor(lengths, at::kLong))
                                .to(device);
  // Each position's share of its run's normalizer (unused by sum normalization).
  const auto run_share = [&] {
    return at::tensor(per_run, at::kDouble).to(device).index_select(0, run_of).to(joint.mask.scalar_type());
  };
  at::Tensor scale = joint.mask;
  if (c.normalization == LossNormalization::kToken) {
    scale = joint.mask * run_share();
  } else if (c.normalization == LossNormalization::kSequence) {
    // Each run's sample_index names its own samples: offset into the runs' samples end to end.
    std::vector<at::Tensor> tokens, index;
    int64_t offset = 0;
    for (size_t j = 0; j < ins.size(); ++j) {
      tokens.push_back(dens[j]->sample_tokens);
      index.push_back(ins[j].sample_index + offset);
      offset += dens[j]->sample_tokens.size(0);
    }
    scale = joint.mask / at::cat(tokens).index_select(0, at::cat(index)).clamp_min(1.0) * run_share();
  }
  PositionSums sums(metrics, run_of);
  return ScaledLoss(c, joint, scale, &sums);
}

}  // namespace lorastep
