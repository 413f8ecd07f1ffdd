#include "lib/training/grad_faults.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace lorastep {

namespace {

// One finalization's faults on one rank.
class GradFaults : public FinalizeFaults {
 public:
  GradFaults(const GradFaultSpec& spec, int rank, bool bucket_fault)
      : spec_(spec), rank_(rank), bucket_fault_(bucket_fault) {}

  int Reductions(const std::string& group) override {
    if (group == "shared_" + spec_.skip_shared_family) return 0;
    if (group.rfind("shared_", 0) == 0) return spec_.shared_reductions;
    if (!bucket_fault_ || group != spec_.bucket) return 1;
    return spec_.kind == "skip" ? 0 : spec_.kind == "double" ? 2 : 1;
  }

  std::string PlanSuffix(const std::string& bucket) override {
    if (bucket == "shared-factor inventory") return rank_ == spec_.inventory_mismatch_rank ? "extra factor\n" : "";
    return bucket_fault_ && spec_.kind == "plan" && spec_.bucket == bucket && spec_.rank == rank_ ? "\nextra parameter"
                                                                                                : "";
  }

  void AfterReduction(const std::string& group, std::vector<at::Tensor>& grads) override {
    const bool family = group.rfind("grad_", 0) == 0;
    const bool corrupt = family ? rank_ == spec_.corrupt_family_rank
                                : bucket_fault_ && spec_.kind == "corrupt" && spec_.bucket == group && spec_.rank == rank_;
    if (corrupt && !grads.empty()) grads[0].view({-1})[0].add_(1e-3);
  }

  bool CheckDigests() override { return spec_.check_digests; }

 private:
  const GradFaultSpec spec_;
  const int rank_;
  const bool bucket_fault_;  // this finalization has the bucket fault
};

class GradFaultSource : public FinalizeFaultSource {
 public:
  explicit GradFaultSource(GradFaultSpec spec) : spec_(std::move(spec)) {}
  std::unique_ptr<FinalizeFaults> Begin(int rank) override {
    const bool bucket_fault = !spec_.bucket.empty() && (spec_.once == nullptr || !spec_.once->exchange(true));
    return std::make_unique<GradFaults>(spec_, rank, bucket_fault);
  }

 private:
  const GradFaultSpec spec_;
};

}  // namespace

absl::Status ParseBucketFault(const std::string& text, const std::string& field, GradFaultSpec* spec) {
  if (text.empty()) return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  static const char* kBuckets[] = {"embedding",    "replicated_partial", "expert_replicated_partial",
                                   "expert_split", "split",              "replicated_full"};
  const bool bucket_known = std::any_of(std::begin(kBuckets), std::end(kBuckets),
                                        [&](const char* b) { return parts[0] == b; });
  int rank = -1;
  const bool on_rank = parts.size() == 3 && (parts[1] == "corrupt" || parts[1] == "plan") &&
                       absl::SimpleAtoi(parts[2], &rank) && rank >= 0;
  const bool whole = parts.size() == 2 && (parts[1] == "skip" || parts[1] == "double");
  if (!bucket_known || !(on_rank || whole)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": '", text,
        "' is not BUCKET:skip, BUCKET:double, BUCKET:corrupt:RANK or BUCKET:plan:RANK with BUCKET one of ",
        absl::StrJoin(kBuckets, ", ")));
  }
  spec->bucket = parts[0];
  spec->kind = parts[1];
  spec->rank = rank;
  return absl::OkStatus();
}

std::shared_ptr<FinalizeFaultSource> MakeGradFaults(const GradFaultSpec& spec) {
  if (spec.empty()) return nullptr;
  return std::make_shared<GradFaultSource>(spec);
}

}  // namespace lorastep
