// The trainable part of a run over a frozen base model: LoRA factors on chosen linears, or,
// with rank 0, a full trainable copy of the weights. Each trainable tensor is a Parameter
// with an fp32 main_grad buffer that backward (fused) or the gradient finalizer (unfused)
// fills. Several adapters can share one frozen base without touching it.
#ifndef LORASTEP_LIB_ADAPTER_H_
#define LORASTEP_LIB_ADAPTER_H_

#include <ATen/ATen.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lib/lora_config.h"
#include "lib/model_config.h"
#include "lib/model_weights.h"

namespace lorastep {

struct Parameter {
  std::string name;      // PEFT key for LoRA factors, Hugging Face name for full weights
  at::Tensor value;      // requires_grad; model dtype
  at::Tensor main_grad;  // fp32, same shape; the gradient the optimizer consumes (a view
                         // into the adapter's flat gradient bucket)
  // The same value on every tensor-parallel rank of a stage, while each rank computes only a
  // partial gradient (the LoRA factor on the unsplit side of a split linear): its gradient
  // is SUM-reduced over the stage's tensor+data group. Else split (or unsplit at tp 1) and
  // reduced over the data group only.
  bool tensor_replicated = false;
};

// Which flat fp32 buffer a parameter's main_grad lives in; one collective covers a bucket.
enum class GradBucket { kSplit = 0, kTensorReplicated = 1 };

// LoRA factors of one linear: y += scale * B (A x). A: [rank, in], B: [out, rank].
struct LoraFactors {
  int a = -1;  // index into Adapter::parameters()
  int b = -1;
};

class Adapter {
 public:
  // LoRA: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))), B = 0,
  // drawn on CPU from `seed` so every device gets the same factors.
  static absl::StatusOr<Adapter> CreateLora(const ModelConfig& model, const LoraConfig& lora,
                                            const at::Device& device, at::ScalarType dtype,
                                            uint64_t seed);
  // rank 0: a trainable copy of every base tensor.
  static Adapter CreateFullFinetune(const ModelWeights& base);

  const LoraConfig& lora_config() const { return lora_; }
  bool full_finetune() const { return lora_.full_finetune(); }

  std::vector<Parameter>& parameters() { return parameters_; }
  const std::vector<Parameter>& parameters() const { return parameters_; }

  // LoRA factors on (layer, slot), or nullptr when that linear has none.
  const LoraFactors* lora(size_t layer, int slot) const;
  // Full fine-tuning: the trainable weights and their main_grads in model layout.
  const ModelWeights& full_weights() const { return full_weights_; }
  const ModelWeights& full_main_grads() const { return full_main_grads_; }

  void ZeroMainGrads();
  // The flat fp32 buffer holding the main_grads of one bucket (undefined when empty).
  const at::Tensor& grad_bucket(GradBucket bucket) const {
    return grad_buckets_[static_cast<int>(bucket)];
  }

  // PEFT key of a LoRA factor: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
  static std::string PeftKey(size_t layer, int slot, bool is_b);

 private:
  // Makes every main_grad a view into one contiguous fp32 buffer per bucket.
  void PackMainGrads();

  LoraConfig lora_;
  std::vector<Parameter> parameters_;
  std::array<at::Tensor, 2> grad_buckets_;
  std::vector<std::array<LoraFactors, kNumLinearSlots>> lora_by_layer_;
  ModelWeights full_weights_;
  ModelWeights full_main_grads_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_ADAPTER_H_
