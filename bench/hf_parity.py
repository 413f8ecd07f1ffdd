"""Parity of lorastep against Hugging Face transformers + PEFT on the same weights.

Runs lorastep_parity (C++) for a model folder, then loads the same safetensors with
transformers' Qwen2ForCausalLM and the exported adapter with PEFT, and compares:
base-model logits, the LoRA loss, and every LoRA factor's gradient.
Usage: python3 bench/hf_parity.py --model DIR --parity-bin build/lorastep_parity
       --device cuda --dtype bfloat16 --out result.json
"""
import argparse, datetime, json, os, subprocess, sys

import torch
from safetensors.torch import load_file


def attn_implementation(model_dir):
    """transformers' attention for the folder: eager for gpt-oss (its sinks have no SDPA path
    in transformers), SDPA for the rest."""
    model_type = json.load(open(os.path.join(model_dir, "config.json"))).get("model_type")
    return "eager" if model_type == "gpt_oss" else "sdpa"


def lora_grads(pm, tokens):
    """Mean next-token cross entropy and the gradient of every LoRA factor, by PEFT key."""
    pm.train()
    logits = pm(input_ids=tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    loss = -logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).mean()
    loss.backward()
    grads = {name.replace(".default", ""): p.grad.float().clone()
             for name, p in pm.named_parameters() if "lora_" in name}
    return loss, grads


def compare(a, b):
    """Global relative error of dict a against reference dict b, and the worst tensor's."""
    num = den = worst = 0.0
    for k, ref in b.items():
        num += (a[k] - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
        worst = max(worst, ((a[k] - ref).norm() / ref.norm().clamp_min(1e-30)).item())
    return (num / den) ** 0.5, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--parity-bin", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default="/tmp/lorastep_parity")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tolerance", type=float, default=2e-2)
    ap.add_argument("--targets", default="", help="LoRA targets, comma-separated (default all-linear)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the tool's 128)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    cmd = [args.parity_bin, "--model", args.model, "--workdir", args.workdir,
           "--device", args.device, "--dtype", args.dtype]
    if args.targets:
        cmd += ["--targets", args.targets]
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    subprocess.run(cmd, check=True)
    ours = load_file(os.path.join(args.workdir, "ours.safetensors"))

    import transformers, peft
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                 attn_implementation=attn_implementation(args.model)).to(args.device)
    model.eval()
    tokens = ours["tokens"].to(args.device)
    with torch.no_grad():
        ref_logits = model(input_ids=tokens).logits.float()
    our_logits = ours["logits"].to(args.device)
    # Noise floor: the same HF model in fp32 against itself in the tested dtype.
    floor = None
    if dtype != torch.float32:
        model32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                       attn_implementation=attn_implementation(args.model)).to(args.device)
        with torch.no_grad():
            logits32 = model32(input_ids=tokens).logits.float()
        floor = ((ref_logits - logits32).norm() / logits32.norm()).item()
        ours_vs_fp32 = ((our_logits - logits32).norm() / logits32.norm()).item()
        grads32 = lora_grads(PeftModel.from_pretrained(model32, os.path.join(args.workdir, "adapter"),
                                                       is_trainable=True), tokens)[1]
        del model32
    diff = (our_logits - ref_logits)
    logits_max_abs = diff.abs().max().item()
    logits_rel = (diff.norm() / ref_logits.norm()).item()

    pm = PeftModel.from_pretrained(model, os.path.join(args.workdir, "adapter"), is_trainable=True)
    loss, ref_grads = lora_grads(pm, tokens)
    our_grads = {k: ours[k].to(args.device) for k in ref_grads}
    assert len(ref_grads) == len([k for k in ours if "lora_" in k]), "parameter sets differ"
    grad_rel, worst = compare(our_grads, ref_grads)
    n = len(ref_grads)
    grad_floor = ours_vs_fp32_grad = None
    if floor is not None:
        grad_floor = compare(ref_grads, grads32)[0]
        ours_vs_fp32_grad = compare(our_grads, grads32)[0]
    result = {
        "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "peft_version": peft.__version__, "dtype": args.dtype,
        "command": " ".join(sys.argv),
        "tokens_shape": list(tokens.shape), "model_type": model.config.model_type,
        "hf_class": type(model).__name__,
        "logits_max_abs_diff": logits_max_abs, "logits_rel_err": logits_rel,
        "loss_ours": ours["loss"].item(), "loss_peft": loss.item(),
        "lora_grad_rel_err": grad_rel, "lora_grad_worst_tensor_rel_err": worst,
        "peft_dtype_vs_peft_fp32_grad_rel_err": grad_floor,
        "ours_dtype_vs_peft_fp32_grad_rel_err": ours_vs_fp32_grad,
        "lora_tensors_compared": n, "tolerance": args.tolerance,
        "hf_dtype_vs_hf_fp32_logits_rel_err": floor,
        "ours_dtype_vs_hf_fp32_logits_rel_err": ours_vs_fp32 if floor is not None else None,
    }
    result["pass"] = result["logits_rel_err"] < args.tolerance and result["lora_grad_rel_err"] < args.tolerance
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
