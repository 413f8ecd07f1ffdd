"""Every model family and RoPE variant lorastep serves, against transformers + PEFT.

For each case a small random model is built by transformers itself (its own config class and
save_pretrained: the config.json and safetensors a user would have), then bench/hf_parity.py
compares lorastep's logits and LoRA gradients with transformers + PEFT, in fp32 and in bf16
(with bf16's floor: transformers' own bf16 against its fp32).
Usage: python3 bench/families.py --parity-bin build-gpu/lorastep_parity --out families.json
"""
import argparse, datetime, json, os, subprocess, sys

import torch

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6)


# LoRA targets per case (default all-linear). The MoE rows put LoRA on the attention: the
# routed experts' LoRA is checked against PEFT by the MoE harness (bench/moe_results.py).
TARGETS = {"qwen3_moe": "q_proj,k_proj,v_proj,o_proj", "qwen3_moe_num_experts": "q_proj,k_proj,v_proj,o_proj",
           # gpt-oss's experts through PEFT's target_parameters (the exported adapter's form)
           "gpt_oss": "q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj",
           "qwen3_5_moe": "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj"}


def cases():
    """(name, model_type, config kwargs, rope dict or None)."""
    yield "qwen2", "qwen2", dict(tie_word_embeddings=True), None
    yield "qwen3", "qwen3", dict(head_dim=32, tie_word_embeddings=True), None
    yield "llama", "llama", dict(head_dim=16, tie_word_embeddings=False, rope_theta=500000.0), \
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=64)
    yield "llama_tied", "llama", dict(tie_word_embeddings=True, rope_theta=500000.0), \
        dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=64)
    yield "qwen3_moe", "qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         tie_word_embeddings=False), None
    # The same, with the expert count under the other name than the one transformers wrote.
    yield "qwen3_moe_num_experts", "qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=True,
                                                     tie_word_embeddings=False), None
    yield "qwen2_linear", "qwen2", {}, dict(rope_type="linear", factor=4.0)
    yield "qwen2_dynamic", "qwen2", dict(max_position_embeddings=64), dict(rope_type="dynamic", factor=4.0)
    yield "qwen2_yarn", "qwen2", {}, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    # Qwen2 with its older sliding-window keys: layers from max_window_layers on slide.
    yield "qwen2_swa", "qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), None
    # gpt-oss: sinks, a sliding layer (layer 0), biased router and experts, clamped SwiGLU, YaRN.
    yield "gpt_oss", "gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                     sliding_window=6, tie_word_embeddings=False, rms_norm_eps=1e-5), \
        dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=128)
    # Qwen3.5: a Gated DeltaNet layer, then gated attention (partial RoPE, zero-centered norms);
    # and its MoE variant (routed experts, gated shared expert; no intermediate_size).
    hybrid = dict(head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
                  layer_types=["linear_attention", "full_attention"])
    yield "qwen3_5", "qwen3_5_text", hybrid, dict(rope_type="default", partial_rotary_factor=0.25)
    yield "qwen3_5_moe", "qwen3_5_moe_text", dict(hybrid, intermediate_size=None, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, shared_expert_intermediate_size=32), \
        dict(rope_type="default", partial_rotary_factor=0.25)


def build(model_type, kwargs, rope, folder):
    from transformers import AutoConfig, AutoModelForCausalLM
    args = {k: v for k, v in dict(SMALL, **kwargs).items() if v is not None}  # None: a key the class lacks
    theta = args.pop("rope_theta", 10000.0)
    config = None
    if rope is not None:
        for spelling in ("rope_parameters", "rope_scaling"):  # transformers 5, then 4
            try:
                params = dict(rope, rope_theta=theta) if spelling == "rope_parameters" else dict(rope)
                extra = {} if spelling == "rope_parameters" else {"rope_theta": theta}
                config = AutoConfig.for_model(model_type, **args, **extra, **{spelling: params})
                break
            except Exception as e:  # the other spelling
                last = e
        if config is None:
            raise last
    else:
        config = AutoConfig.for_model(model_type, **args, rope_theta=theta)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # fresh norms are all ones: perturb them so a missing norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return json.load(open(os.path.join(folder, "config.json")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parity-bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/lorastep_families")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args()
    import transformers, peft
    families = {}
    for name, model_type, kwargs, rope in cases():
        if args.only and name not in args.only.split(","):
            continue
        folder = os.path.join(args.workdir, name, "model")
        entry = {"model_type": model_type}
        try:
            written = build(model_type, kwargs, rope, folder)
            entry["config_rope"] = written.get("rope_parameters") or written.get("rope_scaling")
            if name == "qwen3_moe_num_experts":  # rename the expert count's key
                old = "num_local_experts" if "num_local_experts" in written else "num_experts"
                written["num_experts" if old == "num_local_experts" else "num_local_experts"] = written.pop(old)
                json.dump(written, open(os.path.join(folder, "config.json"), "w"), indent=2)
            entry["expert_count_key"] = next((k for k in ("num_local_experts", "num_experts") if k in written), None)
            for dtype in ("float32", "bfloat16"):
                out = os.path.join(args.workdir, name, f"parity_{dtype}.json")
                run = subprocess.run([sys.executable, "bench/hf_parity.py", "--model", folder, "--parity-bin",
                                      args.parity_bin, "--device", "cuda", "--dtype", dtype, "--seq", "128",
                                      "--workdir", os.path.join(args.workdir, name, dtype), "--out", out]
                                     + (["--targets", TARGETS[name]] if name in TARGETS else []),
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(f"{dtype}: {run.stderr[-1500:]}")
                r = json.load(open(out))
                if dtype == "float32":
                    entry["fp32_logits_rel_err"] = r["logits_rel_err"]
                    entry["fp32_lora_grad_rel_err"] = r["lora_grad_rel_err"]
                else:
                    entry["bf16_logits_rel_err_vs_hf_fp32"] = r["ours_dtype_vs_hf_fp32_logits_rel_err"]
                    entry["bf16_lora_grad_rel_err"] = r["ours_dtype_vs_peft_fp32_grad_rel_err"]
                    entry["bf16_floor"] = r["peft_dtype_vs_peft_fp32_grad_rel_err"]
                    entry["bf16_logits_floor"] = r["hf_dtype_vs_hf_fp32_logits_rel_err"]
            entry["pass"] = (entry["fp32_logits_rel_err"] < 1e-5 and entry["fp32_lora_grad_rel_err"] < 1e-5
                             and entry["bf16_lora_grad_rel_err"] <= 2 * entry["bf16_floor"])
        except Exception as e:
            entry["error"] = str(e)[-2000:]
            entry["pass"] = False
        families[name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "config_rope"}), flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": torch.cuda.get_device_name(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "peft_version": peft.__version__,
        "command": " ".join(sys.argv),
        "what": "random small models written by transformers' save_pretrained; logits and LoRA (r32, all "
                "linears; the MoE rows: attention) gradients of 2 x 128 tokens against transformers + PEFT; bf16 "
                "against their fp32, with the floor of transformers' own bf16",
        "families": families,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
