// Produces what the Hugging Face / PEFT parity check compares against (bench/hf_parity.py):
// for a model folder, it draws a random LoRA adapter (nonzero B), exports it in PEFT format,
// then writes to --workdir/ours.safetensors:
//   tokens        int64 [b, s]      the inputs (seeded)
//   logits        fp32  [b, s, V]   base-model logits (no adapter)
//   loss          fp32  []          mean next-token cross entropy with the adapter
//   <PEFT key>    fp32              the adapter's main_grad for that loss, in the exported
//                                   adapter's form (gpt-oss experts: target_parameters)
//   lorastep_parity --model DIR --workdir DIR [--device cuda] [--dtype bfloat16] [--rank 32]
//                   [--targets q_proj,k_proj,v_proj,o_proj]  (default all-linear)
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "lib/flags_util.h"

#include "lib/training/grad_finalizer.h"
#include "lib/model/logprobs.h"
#include "lib/model/peft_io.h"
#include "lib/model/qwen2.h"
#include "lib/io/tensor_bytes.h"
#include "lib/training/trainer.h"

using namespace lorastep;

int Fail(const absl::Status& s) {
  std::cerr << s << "\n";
  return 1;
}

ABSL_FLAG(std::string, model, "", "model folder; required");
ABSL_FLAG(std::string, workdir, "", "where the adapter and the tensors are written; required");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(std::string, dtype, "", "model dtype (default: config.json's)");
ABSL_FLAG(int64_t, rank, 32, "LoRA rank (alpha = rank)");
ABSL_FLAG(int64_t, seq, 128, "tokens per sequence");
ABSL_FLAG(std::string, targets, "", "LoRA targets, comma-separated (default all-linear)");

int main(int argc, char** argv) {
  ParseCommandLineOrExit(argc, argv, "lorastep_parity --model DIR --workdir DIR [--device cuda] [--dtype D] "
                                     "[--rank R] [--seq S] [--targets q_proj,...]");
  const std::string model = absl::GetFlag(FLAGS_model), workdir = absl::GetFlag(FLAGS_workdir),
                    device = absl::GetFlag(FLAGS_device), dtype = absl::GetFlag(FLAGS_dtype),
                    lora_targets = absl::GetFlag(FLAGS_targets);
  const int64_t rank = absl::GetFlag(FLAGS_rank), batch = 2, seq = absl::GetFlag(FLAGS_seq);
  if (model.empty() || workdir.empty()) return Fail(absl::InvalidArgumentError("--model and --workdir are required"));
  auto base = LoadBaseModel(model, device, dtype);
  if (!base.ok()) return Fail(base.status());
  TrainerOptions options;
  options.lora.rank = rank;
  options.lora.alpha = static_cast<double>(rank);
  if (!lora_targets.empty()) options.lora.target_modules = absl::StrSplit(lora_targets, ',');
  options.seed = 5;
  auto trainer = Trainer::Create(*base, options);
  if (!trainer.ok()) return Fail(trainer.status());
  Adapter& adapter = (*trainer)->mutable_adapter();
  {
    at::NoGradGuard g;
    at::manual_seed(11);
    for (auto& p : adapter.parameters()) {
      if (p.name.find("lora_B") != std::string::npos) {
        p.value.copy_(at::randn(p.value.sizes()) * 0.02);
      }
    }
  }
  const ModelConfig& c = (*base)->config;
  // The model's PEFT form: Qwen3.5's DeltaNet projections listed, gpt-oss's experts as PEFT's
  // target_parameters (whose factors' gradients are the same reshapes of lorastep's).
  const PeftExportOptions peft = PeftOptionsFor(c, options.lora, false);
  if (auto s = ExportPeftAdapter(workdir + "/adapter", adapter, model, nullptr, peft); !s.ok()) return Fail(s);

  at::manual_seed(3);
  at::Tensor tokens = at::randint(0, c.vocab_size, {batch, seq}, at::kLong);
  at::Tensor tokens_dev = tokens.to((*base)->device);
  TensorWriteList out;
  ForwardOptions fwd;
  fwd.training = false;
  {
    at::NoGradGuard g;
    at::Tensor hidden = Qwen2Hidden(c, (*base)->weights, nullptr, tokens_dev, fwd);
    at::Tensor logits = at::matmul(hidden, (*base)->weights.output_weight().t()).to(at::kFloat);
    if (auto s = out.Add("logits", logits); !s.ok()) return Fail(s);
  }
  // Cross entropy of predicting tokens[:, 1:] from tokens[:, :-1], mean over positions.
  at::Tensor hidden = Qwen2Hidden(c, (*base)->weights, &adapter, tokens_dev, fwd);
  at::Tensor h = hidden.narrow(1, 0, seq - 1).reshape({-1, c.hidden_size});
  at::Tensor targets = tokens_dev.narrow(1, 1, seq - 1).reshape({-1});
  // The head with its LoRA when lm_head is among the targets (--targets ...,lm_head).
  TokenScores scores = Qwen2HeadScores((*base)->weights, &adapter, h, targets, 1024, fwd, {}, true);
  at::Tensor loss = -scores.logprobs.mean();
  loss.backward();
  if (auto s = FoldLocalGradients(&adapter); !s.ok()) return Fail(s);
  if (auto s = out.Add("tokens", tokens); !s.ok()) return Fail(s);
  if (auto s = out.Add("loss", loss.detach().to(at::kFloat)); !s.ok()) return Fail(s);
  for (const auto& p : adapter.parameters()) {
    for (const auto& [key, grad] : PeftTensorsOf(p.name, p.main_grad, peft)) {
      if (auto s = out.Add(key, grad.contiguous()); !s.ok()) return Fail(s);
    }
  }
  if (auto s = out.WriteTo(workdir + "/ours.safetensors"); !s.ok()) return Fail(s);
  std::cout << "loss " << loss.item<double>() << "; wrote " << workdir << "/ours.safetensors\n";
  return 0;
}
