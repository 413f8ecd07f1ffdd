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
  at::Tensor main_grad;  // fp32, same shape; the gradient the optimizer consumes
};

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

  // PEFT key of a LoRA factor: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
  static std::string PeftKey(size_t layer, int slot, bool is_b);

 private:
  LoraConfig lora_;
  std::vector<Parameter> parameters_;
  std::vector<std::array<LoraFactors, kNumLinearSlots>> lora_by_layer_;
  ModelWeights full_weights_;
  ModelWeights full_main_grads_;
};

}  // namespace lorastep

#endif  // LORASTEP_LIB_ADAPTER_H_
