"""Turns the raw files of bench/step_bench.sh into bench/results/step.json and one table.
Model FLOPs are counted honestly: M = the parameters of every matmul (all linear layers
and the LM head; the embedding lookup is not a matmul), per token 2M forward, 4M for a
LoRA step (forward + input gradients; frozen weights have no weight gradient) and 6M for
full fine-tuning, plus causal attention (QK^T and AV: 4 * layers * heads*head_dim FLOPs per
query-key pair, n(n+1)/2 pairs per sequence; x3 with backward). MFU is against the bf16
GEMM peak measured in the same run (bench/gemm_peak.py).
    python3 bench/step_results.py RAW_DIR MODEL_DIR OUT.json [--cpu CPU.json] [--command C]
"""
import argparse, json, os


def model_flops(cfg, lengths, weight_passes):
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter
    m = layers * per_layer + vocab * h
    tokens = sum(lengths)
    attn_fwd = sum(4 * layers * heads * d * n * (n + 1) / 2 for n in lengths)
    return 2 * weight_passes * m * tokens + (3 if weight_passes > 1 else 1) * attn_fwd, m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--cpu", default="")
    ap.add_argument("--micro_batch", default="8192")
    ap.add_argument("--command", default=os.environ.get("BENCH_COMMAND", "python3 scripts/bench.py suite step"))
    args = ap.parse_args()
    raw = lambda name: json.load(open(os.path.join(args.raw, name)))
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    batches = {w: [len(s["tokens"]) for s in json.load(open(os.path.join(args.raw, f"batch_{w}.json")))["sequences"]]
               for w in ("fixed", "varlen")}
    peak = raw("gemm_peak.json")["tflops"]
    env = open(os.path.join(args.raw, "env.txt")).read().splitlines()
    rows = []

    def row(side, mode, workload, seconds, peak_gib, passes):
        flops, m = model_flops(cfg, batches[workload], passes)
        tokens = sum(batches[workload])
        r = {"side": side, "mode": mode, "workload": workload, "step_s": seconds,
             "tokens_per_s": tokens / seconds, "model_tflops": flops / seconds / 1e12,
             "mfu": flops / seconds / 1e12 / peak, "peak_cuda_gib": peak_gib}
        rows.append(r)
        return r

    passes = {"lora": 2, "full": 3, "logprobs": 1}
    ours, hf = {}, {}
    timed_calls = 0  # lorastep's timed calls per row (bench/step_bench.sh's STEP_COUNT)
    for (mode, workload) in [("lora", "fixed"), ("full", "fixed"), ("logprobs", "fixed"), ("lora", "varlen"), ("full", "varlen")]:
        name = f"ours_{mode}_{workload}.json"
        if os.path.exists(os.path.join(args.raw, name)):
            d = raw(name)
            timed_calls = max(timed_calls, len(d.get("worker_step_s", [])))
            ours[(mode, workload)] = row("lorastep", mode, workload, d["worker_step_median_s"], d.get("peak_cuda_gib"), passes[mode])
            # (client wall - worker step) / client wall, median over the timed calls
            ours[(mode, workload)]["service_overhead"] = d.get("overhead_fraction")
        name = f"hf_{mode}_{workload}.json"
        if os.path.exists(os.path.join(args.raw, name)):
            d = raw(name)
            hf[(mode, workload)] = row("transformers" + (" + PEFT" if mode == "lora" else ""), mode, workload,
                                       d["step_s"], d["peak_memory_gib"], passes[mode])
    for name in sorted(os.listdir(args.raw)):  # extra micro-batch sizes (ours_MODE_W_mbN.json)
        if name.startswith("ours_") and "_mb" in name:
            mode, workload, mb = name[len("ours_"):-len(".json")].split("_")
            d = raw(name)
            row(f"lorastep ({mb})", mode, workload, d["worker_step_median_s"], d.get("peak_cuda_gib"), passes[mode])
    f = lambda t, k, key: t[k][key] if k in t else None
    out = {
        "date": raw("gemm_peak.json").get("date") or raw("hf_lora_fixed.json")["date"],
        "machine": env[0].replace("machine: ", ""),
        "library_versions": env[-1] if len(env) > 1 else "",
        "command": args.command,
        "commit": os.environ.get("BENCH_COMMIT", "unknown"),
        "lorastep_micro_batch_tokens": int(args.micro_batch),
        "model": "random Qwen2.5-0.5B shape (lorastep_genmodel --preset qwen2.5-0.5b --seed 1), bf16",
        "workloads": {"fixed": "64 x 512 tokens", "varlen": f"64 sequences of 128-1024 tokens ({sum(batches['varlen'])} tokens)"},
        "lorastep_lora_train_s": f(ours, ("lora", "fixed"), "step_s"),
        "lorastep_full_train_s": f(ours, ("full", "fixed"), "step_s"),
        "hf_peft_lora_train_s": f(hf, ("lora", "fixed"), "step_s"),
        "hf_full_train_s": f(hf, ("full", "fixed"), "step_s"),
        "lorastep_logprobs_s": f(ours, ("logprobs", "fixed"), "step_s"),
        "hf_logprobs_s": f(hf, ("logprobs", "fixed"), "step_s"),
        "lorastep_lora_peak_gib": f(ours, ("lora", "fixed"), "peak_cuda_gib"),
        "hf_peft_lora_peak_gib": f(hf, ("lora", "fixed"), "peak_cuda_gib"),
        "lorastep_fixed_tokens_per_s": f(ours, ("lora", "fixed"), "tokens_per_s"),
        "lorastep_varlen_tokens_per_s": f(ours, ("lora", "varlen"), "tokens_per_s"),
        "gemm_peak_tflops": peak,
        "lorastep_lora_mfu": f(ours, ("lora", "fixed"), "mfu"),
        "cpu_demo_flops_fraction": json.load(open(args.cpu))["cpu_demo_flops_fraction"] if args.cpu else None,
        # The same calls' service overhead: (client wall - worker time_step_s) / client wall, in
        # the step suite's deployment; the default deployment's is the service suite's
        # (bench/service_results.py: service_overhead_lora and its ratio).
        "step_suite_service_overhead_lora": f(ours, ("lora", "fixed"), "service_overhead"),
        "step_suite_service_overhead_full": f(ours, ("full", "fixed"), "service_overhead"),
        "step_suite_service_overhead_logprobs": f(ours, ("logprobs", "fixed"), "service_overhead"),
        "rows": rows,
        "method": "lorastep: the worker's time_step_s (Forward: time_forward_s + time_data_s) through coordinator + worker, "
                  f"median of {timed_calls} timed calls after one warm-up; transformers: bench/peft_step.py, median of 3 after one "
                  "warm-up, CUDA synchronized. Same safetensors and the same batch files for both.",
    }
    try:
        out["ratios"] = {
            "lora_over_full_step (target <= 0.7)": out["lorastep_lora_train_s"] / out["lorastep_full_train_s"],
            "lora_tokens_per_s_over_peft (target >= 4)": out["hf_peft_lora_train_s"] / out["lorastep_lora_train_s"],
            "full_tokens_per_s_over_hf_full (target >= 1.5)": out["hf_full_train_s"] / out["lorastep_full_train_s"],
            "hf_logprobs_over_ours (target >= 2)": out["hf_logprobs_s"] / out["lorastep_logprobs_s"],
            "lora_peak_over_peft_peak (target <= 0.6)": out["lorastep_lora_peak_gib"] / out["hf_peft_lora_peak_gib"],
            "varlen_over_fixed_tokens_per_s (target >= 0.9)": out["lorastep_varlen_tokens_per_s"] / out["lorastep_fixed_tokens_per_s"],
        }
    except (TypeError, ZeroDivisionError):
        pass
    json.dump(out, open(args.out, "w"), indent=2)
    print(f"lorastep micro-batch: {args.micro_batch} padded tokens (rows marked mbN: N)")
    print(f"{'side':22} {'mode':9} {'workload':8} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        pk = f"{r['peak_cuda_gib']:.2f}" if r["peak_cuda_gib"] is not None else "-"
        print(f"{r['side']:22} {r['mode']:9} {r['workload']:8} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} "
              f"{r['model_tflops']:8.1f} {r['mfu']:6.1%} {pk:>9}")
    print(f"bf16 GEMM peak {peak:.0f} TFLOP/s")
    for k, v in out.get("ratios", {}).items():
        print(f"  {k}: {v:.3f}")


if __name__ == "__main__":
    main()
