#include "lib/training/adamw.h"
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lib/status_macros.h"
#include "lib/training/sums_of_squares.h"

#ifdef LORASTEP_WITH_CUDA_KERNELS
#include "lib/kernels/adamw_flat.h"
#include "lib/kernels/kernel_launch.h"
#endif

namespace lorastep {

AdamW::AdamW(Adapter* adapter) : adapter_(adapter) {
  const auto& params = adapter_->parameters();
  order_ = adapter_->BucketOrder();
  if (order_.size() != params.size()) {  // a role outside the buckets: parameter order
    order_.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) order_[i] = static_cast<int>(i);
  }
  offsets_.assign(params.size(), 0);
  int64_t total = 0;
  for (int i : order_) {
    offsets_[i] = total;
    total += params[i].value.numel();
    same_dtype_ = same_dtype_ && params[i].value.scalar_type() == params.front().value.scalar_type();
  }
  if (params.empty()) return;
  // One flat fp32 buffer per state; the per-parameter tensors are views of it, so a step is a
  // dozen kernels over the flat buffers instead of a dozen per parameter.
  const auto f32 = params.front().value.options().dtype(at::kFloat).requires_grad(false);
  flat_master_ = at::empty({total}, f32);
  flat_avg_ = at::zeros({total}, f32);
  flat_avg_sq_ = at::zeros({total}, f32);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].value.numel();
    const auto shape = params[i].value.sizes();
    master_.push_back(flat_master_.narrow(0, offsets_[i], n).view(shape));
    exp_avg_.push_back(flat_avg_.narrow(0, offsets_[i], n).view(shape));
    exp_avg_sq_.push_back(flat_avg_sq_.narrow(0, offsets_[i], n).view(shape));
    master_.back().copy_(params[i].value);
  }
  // Whether the gradients and values already lie in this order in one place each.
  std::array<int64_t, kNumGradBuckets> in_bucket{};
  grads_packed_ = true;
  for (int i : order_) {
    const Parameter& p = params[i];
    const bool in_range = p.role >= 0 && p.role < kNumGradBuckets;
    const at::Tensor& bucket = in_range ? adapter_->grad_bucket(static_cast<GradBucket>(p.role)) : at::Tensor();
    grads_packed_ = grads_packed_ && bucket.defined() && p.main_grad.defined() && p.main_grad.is_contiguous() &&
                    p.main_grad.data_ptr<float>() == bucket.data_ptr<float>() + in_bucket[p.role];
    if (!grads_packed_) break;
    in_bucket[p.role] += p.value.numel();
  }
  for (int b = 0; b < kNumGradBuckets && grads_packed_; ++b) {
    const at::Tensor& bucket = adapter_->grad_bucket(static_cast<GradBucket>(b));
    grads_packed_ = bucket.defined() ? bucket.numel() == in_bucket[b] : in_bucket[b] == 0;
  }
#ifdef LORASTEP_WITH_CUDA_KERNELS
  static_assert(kNumGradBuckets <= kernels::FlatParts::kMaxParts, "a part per bucket");
  fused_ = flat_master_.is_cuda() && same_dtype_ && grads_packed_;
#endif
  const at::Tensor& packed = adapter_->packed_values();
  values_packed_ = packed.defined() && packed.numel() == total;
  for (size_t i = 0; i < params.size() && values_packed_; ++i) {
    values_packed_ = params[i].value.is_contiguous() && params[i].value.scalar_type() == packed.scalar_type() &&
                     params[i].value.data_ptr() ==
                         static_cast<char*>(packed.data_ptr()) + offsets_[i] * static_cast<int64_t>(packed.element_size());
  }
}

std::vector<at::Tensor> AdamW::GradBuckets() const {
  std::vector<at::Tensor> buckets;
  for (int b = 0; b < kNumGradBuckets; ++b) {
    const at::Tensor& bucket = adapter_->grad_bucket(static_cast<GradBucket>(b));
    if (bucket.defined() && bucket.numel() > 0) buckets.push_back(bucket);
  }
  return buckets;
}

at::Tensor AdamW::FlatGradients() const {
  std::vector<at::Tensor> parts;
  if (grads_packed_) {
    parts = GradBuckets();
  } else {
    for (int i : order_) parts.push_back(adapter_->parameters()[i].main_grad.reshape({-1}));
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts);  // read only: may be the bucket itself
}

AdamW::Coefficients AdamW::StepCoefficients(const AdamWParams& p, double norm) const {
  Coefficients k;
  k.clip = (p.max_grad_norm > 0 && norm > p.max_grad_norm) ? p.max_grad_norm / (norm + 1e-6) : 1.0;
  k.lr = ScheduledLearningRate(p, steps_);
  k.t = steps_ + 1;
  k.bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(k.t));
  k.bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(k.t));
  return k;
}

AdamW::Update AdamW::CandidateUpdate(const AdamWParams& p, const Coefficients& k) const {
  // PyTorch's AdamW with the clip factor folded into the moments' coefficients: no clipped
  // copy of the gradients, every temporary updated in place.
  const at::Tensor g = FlatGradients();
  Update u;
  u.exp_avg = flat_avg_.mul(p.beta1).add_(g, (1.0 - p.beta1) * k.clip);
  u.exp_avg_sq = flat_avg_sq_.mul(p.beta2).addcmul_(g, g, (1.0 - p.beta2) * k.clip * k.clip);
  const at::Tensor denom = u.exp_avg_sq.sqrt().div_(std::sqrt(k.bc2)).add_(p.eps);
  u.master = flat_master_.mul(1.0 - k.lr * p.weight_decay).addcdiv_(u.exp_avg, denom, -k.lr / k.bc1);
  return u;
}

#ifdef LORASTEP_WITH_CUDA_KERNELS
namespace {

// The flat gradient's parts for the kernel: the grad buckets, end to end.
kernels::FlatParts GradientParts(const std::vector<at::Tensor>& buckets) {
  kernels::FlatParts out;
  int64_t end = 0;
  for (const at::Tensor& bucket : buckets) {
    TORCH_CHECK(bucket.scalar_type() == at::kFloat && bucket.is_contiguous(), "AdamW: grad buckets must be contiguous fp32");
    end += bucket.numel();
    out.data[out.count] = bucket.data_ptr<float>();
    out.ends[out.count++] = end;
  }
  return out;
}

}  // namespace

// One pass of the fused kernel: `write` false leaves the state alone and returns the new
// values' largest magnitude on the device; true writes the step in place (allocating nothing).
at::Tensor AdamW::FusedPass(const AdamWParams& p, const Coefficients& k, bool write) const {
  kernels::AdamWScalars s;
  s.beta1 = static_cast<float>(p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.grad_weight = static_cast<float>((1.0 - p.beta1) * k.clip);
  s.square_weight = static_cast<float>((1.0 - p.beta2) * k.clip * k.clip);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(k.bc2));
  s.eps = static_cast<float>(p.eps);
  s.decay = static_cast<float>(1.0 - k.lr * p.weight_decay);
  s.step = static_cast<float>(-k.lr / k.bc1);
  at::Tensor largest = write ? at::Tensor() : at::zeros({}, flat_master_.options());
  kernels::KernelLaunch launch(flat_master_);
  kernels::CheckLaunch(kernels::LaunchAdamWFlat(GradientParts(GradBuckets()), flat_avg_.data_ptr<float>(),
                                                flat_avg_sq_.data_ptr<float>(), flat_master_.data_ptr<float>(),
                                                flat_master_.numel(), s, write,
                                                write ? nullptr : largest.data_ptr<float>(), launch.stream),
                       "AdamW");
  return largest;
}
#endif

absl::Status AdamW::CheckStep(const AdamWParams& p, double norm) const { return Stage(p, norm).status(); }

absl::StatusOr<AdamW::StagedStep> AdamW::Stage(const AdamWParams& p, double norm) const {
  LORASTEP_ASSIGN_OR_RETURN(StagedStep staged, StageOnDevice(p, norm));
  LORASTEP_RETURN_IF_ERROR(CheckStaged(staged));
  return staged;
}

absl::StatusOr<AdamW::StagedStep> AdamW::StageOnDevice(const AdamWParams& p, double norm) const {
  LORASTEP_RETURN_IF_ERROR(ValidateAdamWParams(p));
  if (!std::isfinite(norm)) {
    return absl::FailedPreconditionError(
        "optimizer: non-finite gradient norm; step refused, parameters unchanged");
  }
  StagedStep staged;
  staged.p = p;
  staged.k = StepCoefficients(p, norm);
  staged.grad_norm = norm;
  const auto& params = adapter_->parameters();
  if (params.empty()) return staged;
  at::NoGradGuard no_grad;
#ifdef LORASTEP_WITH_CUDA_KERNELS
  if (fused_) {
    staged.largest = FusedPass(p, staged.k, /*write=*/false);
    return staged;
  }
#endif
  staged.u = CandidateUpdate(p, staged.k);
  // One dtype: the largest magnitude (NaN if any is NaN) says whether every value stays finite
  // once rounded to that dtype (rounding is monotonic). Mixed dtypes: each part checked in its own.
  if (same_dtype_) {
    staged.largest = at::linalg_vector_norm(staged.u.master, INFINITY, c10::nullopt, false, c10::nullopt);
  } else {
    std::vector<at::Tensor> bad;
    for (int i : order_) {
      bad.push_back(at::isfinite(staged.u.master.narrow(0, offsets_[i], params[i].value.numel())
                                     .to(params[i].value.scalar_type())).logical_not_().any().reshape({1}));
    }
    staged.largest = at::cat(bad).any().to(at::kFloat);  // 0, or 1 when a part is non-finite
  }
  return staged;
}

absl::Status AdamW::CheckStaged(const StagedStep& staged, std::optional<float> largest) const {
  const auto& params = adapter_->parameters();
  if (!staged.largest.defined() || params.empty()) return absl::OkStatus();
  const float value = largest.has_value() ? *largest : staged.largest.item<float>();
  const at::Tensor rounded = at::scalar_tensor(value, at::kFloat).to(params.front().value.scalar_type());
  if (same_dtype_ ? at::isfinite(rounded).item<bool>() : value == 0.0f) return absl::OkStatus();
  // The refusal names the first parameter (flat order) the update would leave non-finite (on
  // the fused path the update is computed aside for that, once refused).
  const at::Tensor candidate = staged.u.master.defined() ? staged.u.master : CandidateUpdate(staged.p, staged.k).master;
  std::string name = "a parameter";
  for (int i : order_) {
    const at::Tensor part = candidate.narrow(0, offsets_[i], params[i].value.numel());
    if (!at::isfinite(part.to(params[i].value.scalar_type())).all().item<bool>()) {
      name = params[i].name;
      break;
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "optimizer: the update would make ", name, " non-finite; step refused, parameters unchanged"));
}

absl::StatusOr<OptimizerStepResult> AdamW::Step(const AdamWParams& p,
                                                c10::optional<double> grad_norm) {
  auto valid = ValidateAdamWParams(p);
  if (!valid.ok()) return valid;
  auto& params = adapter_->parameters();
  at::NoGradGuard no_grad;
  // Global L2 norm over every main_grad, in fp64 so the sum does not lose small terms.
  double norm = 0.0;
  if (grad_norm.has_value()) {
    norm = *grad_norm;
  } else {
    // Summed on the device: one host synchronization, not one per parameter.
    std::vector<SquareTerm> terms;
    for (const Parameter& prm : params) terms.push_back({prm.main_grad});
    const at::Device device = params.empty() ? at::Device(at::kCPU) : params.front().main_grad.device();
    norm = std::sqrt(GroupSumsOfSquares({terms}, device)[0].item<double>());
  }
  LORASTEP_ASSIGN_OR_RETURN(StagedStep staged, Stage(p, norm));
  return Commit(std::move(staged));
}

OptimizerStepResult AdamW::Commit(StagedStep staged) {
  at::NoGradGuard no_grad;
  auto& params = adapter_->parameters();
  if (!params.empty()) {
    if (fused_) {
#ifdef LORASTEP_WITH_CUDA_KERNELS
      FusedPass(staged.p, staged.k, /*write=*/true);
#endif
    } else {
      flat_avg_.copy_(staged.u.exp_avg);
      flat_avg_sq_.copy_(staged.u.exp_avg_sq);
      flat_master_.copy_(staged.u.master);
    }
    if (values_packed_) {
      adapter_->packed_values().copy_(flat_master_);  // every value, one kernel
    } else {
      for (size_t i = 0; i < params.size(); ++i) params[i].value.copy_(master_[i]);
    }
  }
  adapter_->ZeroMainGrads();
  steps_ = staged.k.t;
  return OptimizerStepResult{staged.grad_norm, staged.k.lr, staged.k.t};
}

void AdamW::ResyncFromParameters() {
  at::NoGradGuard no_grad;
  const auto& params = adapter_->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    master_[i].copy_(params[i].value);
    exp_avg_[i].zero_();
    exp_avg_sq_[i].zero_();
  }
}

}  // namespace lorastep
