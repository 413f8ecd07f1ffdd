// The trainable part of a run over a frozen base model: LoRA factors on chosen linears, or,
// with rank 0, a full trainable copy of the weights. Each trainable tensor is a Parameter
// with an fp32 main_grad buffer that backward (fused) or the gradient finalizer (unfused)
// fills. Several adapters can share one frozen base without touching it.
#ifndef LORASTEP_LIB_MODEL_ADAPTER_H_
#define LORASTEP_LIB_MODEL_ADAPTER_H_

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/model/lora_config.h"
#include "lib/model/model_config.h"
#include "lib/model/model_weights.h"

namespace lorastep {

struct Parameter {
  std::string name;      // PEFT key for LoRA factors, Hugging Face name for full weights
  at::Tensor value;      // requires_grad; model dtype
  at::Tensor main_grad;  // fp32, same shape; the gradient the optimizer consumes (a view
                         // into the adapter's flat gradient bucket)
  // How the tensor is laid over the tensor-parallel ranks of a stage; see TensorRole.
  int role = 0;  // a TensorRole
  int split_dim = -1;  // kSplit: the dim cut across tensor ranks (in tensor-rank order)
  // A copy of a tensor another pipeline stage owns too (the tied embedding on the last
  // stage): its gradient is summed over the embedding group, its square is not counted in
  // the norm here, and it is not written twice.
  bool stage_copy = false;
  // Held on both the first and last stage (the tied embedding): SUM over the embedding group.
  bool tied_across_stages = false;
  int64_t layer = -1;     // global decoder layer of a LoRA factor
  std::string family;     // expert factors: "fc1" (gate+up) or "fc2" (down)
  bool expert_split = false;  // dim 0 holds experts, cut over the expert group
  // kSplit along split_dim in groups (LinearSplit::groups: in_proj_qkv's B): each group cut
  // evenly over the tensor ranks. Empty: one contiguous cut.
  std::vector<int64_t> split_groups;
};

// How a trainable tensor sits on the tensor-parallel ranks, which decides its reduction.
//  kSplit: each rank holds a different slice (or the whole tensor at tp 1); its gradient is
//    complete on the rank: SUM over the data group only.
//  kReplicatedPartial: every rank holds the same value but computes only a partial gradient
//    -- the LoRA factor on the unsplit side of a split linear (A of q/k/v/gate/up, B of
//    o/down). SUM over the stage's tensor+data group, exactly once (skipping or repeating it leaves
//    the tensor ranks' copies diverging).
//  kReplicatedFull: same value, and the same complete gradient on every rank (norm weights
//    under full fine-tuning): SUM over the data group; counted once in the norm.
// Routed-expert factors (expert_split: dim 0 cut over the expert group):
//  kExpertSplit: complete on the rank that holds the expert (tokens of every replica of the
//    expert group were sent to it): SUM over the expert-data group.
//  kExpertReplicatedPartial: same value on the tensor ranks, partial gradients (per-expert
//    A of fc1, B of fc2): SUM over the expert-stage group (tensor x expert-data).
//  kSharedExpert: a factor shared by all of a layer's experts (shared-outer fc1 A, fc2 B):
//    every rank of the stage holds it, each with the gradient of its own experts, tokens
//    and tensor slice: SUM over the stage's tensor+data group, exactly once, at final
//    gradient processing, checked by digests.
enum TensorRole {
  kSplit = 0,
  kReplicatedPartial = 1,
  kReplicatedFull = 2,
  kExpertSplit = 3,
  kExpertReplicatedPartial = 4,
  kSharedExpert = 5,
};

// Which flat fp32 buffer a parameter's main_grad lives in: one per TensorRole, so one
// collective covers a bucket (GradBucket::kSplit, ...).
using GradBucket = TensorRole;
constexpr int kNumGradBuckets = 6;
// Whether every rank of the tensor group holds the same value of a tensor of this role.
inline bool TensorReplicated(int role) { return role != kSplit && role != kExpertSplit; }

// LoRA factors of one linear: y += scale * B (A x). A: [rank, in], B: [out, rank].
struct LoraFactors {
  int a = -1;  // index into Adapter::parameters()
  int b = -1;
};

// LoRA factors of a MoE layer's routed experts (indices into Adapter::parameters(); -1 when
// not targeted). Shapes on one rank (E_l experts, I_l columns of each expert's width):
//   fc1_a: per-expert [E_l, r, H], shared-outer [r, H]
//   fc1_b: [E_l, 2, I_l, r]   (gate rows, then up rows: fc1 is gate_proj and up_proj fused)
//   fc2_a: [E_l, r, I_l]
//   fc2_b: per-expert [E_l, H, r], shared-outer [H, r]
struct ExpertLoraFactors {
  int fc1_a = -1, fc1_b = -1, fc2_a = -1, fc2_b = -1;
};

// A factor shared by all experts of a layer, registered when the adapter is built (from the
// adapter kind and the factor's shape). `key` is the stable per-module key that orders the
// collectives identically on every rank ("layers.3.experts.fc1.lora_A").
struct SharedFactor {
  std::string key;
  int param = -1;
  int64_t layer = -1;
  std::string family;           // "fc1" or "fc2"
  std::vector<int64_t> shape;   // the whole factor's shape
};

class Adapter {
 public:
  // LoRA: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))), B = 0,
  // drawn on CPU from `seed` so every device gets the same factors.
  // With a `shard`, the factors are drawn for the whole model (the same stream as world
  // size 1) and this rank keeps its part: the stage's layers; on column-parallel q/k/v/
  // gate/up, A whole (kReplicatedPartial) and B's rows of this rank; on row-parallel o/down,
  // A's columns of this rank and B whole (kReplicatedPartial).
  static absl::StatusOr<Adapter> CreateLora(const ModelConfig& model, const LoraConfig& lora,
                                            const at::Device& device, at::ScalarType dtype,
                                            uint64_t seed, const ModelShard* shard = nullptr);
  // rank 0: a trainable copy of every base tensor this rank's stage uses (of its shard of
  // the base): its layers; the embedding on the first stage; the final norm and LM head on
  // the last (a tied embedding there too). Norms over the hidden size are kReplicatedFull;
  // per-head norms shared by every head (q/k norms, the Gated DeltaNet's gated norm) are
  // kReplicatedPartial, as each tensor rank's heads give part of their gradient; the rest
  // kSplit as the shard cut it (`config`: the model, for the Gated DeltaNet's grouped splits).
  static Adapter CreateFullFinetune(const ModelWeights& base, const ModelShard* shard = nullptr,
                                    bool tied_embeddings = false, const ModelConfig* config = nullptr);

  const LoraConfig& lora_config() const { return lora_; }
  bool full_finetune() const { return lora_.full_finetune(); }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }

  // LoRA factors on (layer, slot), or nullptr when that linear has none. `layer` is the
  // index into this stage's layers.
  const LoraFactors* lora(size_t layer, int slot) const;
  // LoRA on the LM head (lora.target_modules has "lm_head"), on the last stage; else nullptr.
  // A [r, H] is whole on every tensor rank (kReplicatedFull: the vocab-parallel head sums
  // the input gradient over the tensor group, so A's gradient is complete on each); B
  // [V, r] holds this rank's vocabulary rows (kSplit), like the head's weight.
  const LoraFactors* head_lora() const { return head_lora_.a < 0 ? nullptr : &head_lora_; }
  // Routed-expert LoRA of (stage-local) `layer`, or nullptr.
  const ExpertLoraFactors* expert_lora(size_t layer) const;
  // Shared-outer factors in key order (the order of their collectives).
  const std::vector<SharedFactor>& shared_factors() const { return shared_factors_; }
  // Full fine-tuning: the trainable weights and their main_grads in model layout.
  const ModelWeights& full_weights() const { return full_weights_; }
  const ModelWeights& full_main_grads() const { return full_main_grads_; }

  // Zeroes every main_grad and the reduction counts of the step.
  void ZeroMainGrads();
  // Over which groups parameter i's main_grad was reduced since the last ZeroMainGrads, one
  // bit per GroupKind (the finalizer refuses a second reduction over the same group).
  int& reductions(int i) { return reductions_[i]; }
  // The flat fp32 buffer holding the main_grads of one bucket (undefined when empty).
  const at::Tensor& grad_bucket(GradBucket bucket) const {
    return grad_buckets_[static_cast<int>(bucket)];
  }
  // Parameter indices bucket by bucket (in bucket order), parameter order within a bucket:
  // the order of the elements of the grad buckets laid end to end.
  std::vector<int> BucketOrder() const;
  // LoRA: one buffer of the model dtype holding every value, in BucketOrder (each value a
  // view of it), so an optimizer writes all of them in one copy. Undefined for full
  // fine-tuning (its values are the model's weights).
  const at::Tensor& packed_values() const { return packed_values_; }

  // PEFT key of a LoRA factor: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
  static std::string PeftKey(size_t layer, int slot, bool is_b);
  // The LM head's: base_model.model.lm_head.lora_A.weight
  static std::string PeftHeadKey(bool is_b);

 private:
  // Routed-expert LoRA factors of global `layer` (drawn whole, kept in part when `s` is a
  // shard); `add` appends a parameter and returns its index.
  absl::Status AddExpertLora(const ModelConfig& model, const ModelShard& s, int64_t layer,
                             bool fc1, bool fc2, at::Generator& gen,
                             const std::function<int(Parameter, at::Tensor)>& add);
  // Makes every main_grad a view into one contiguous fp32 buffer per bucket.
  void PackMainGrads();
  // Makes every value a view into packed_values_ (before they require grad).
  void PackValues();

  LoraConfig lora_;
  std::vector<Parameter> parameters_;
  std::array<at::Tensor, kNumGradBuckets> grad_buckets_;
  at::Tensor packed_values_;
  std::vector<std::array<LoraFactors, kNumLinearSlots>> lora_by_layer_;
  std::vector<ExpertLoraFactors> expert_lora_by_layer_;
  std::vector<SharedFactor> shared_factors_;
  LoraFactors head_lora_;
  std::vector<int> reductions_;
  ModelWeights full_weights_;
  ModelWeights full_main_grads_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_MODEL_ADAPTER_H_
