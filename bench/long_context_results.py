"""The runs of bench/long_context.sh as figures: tokens/s, peak memory and MFU of each long
sequence (attention FLOPs counted, recomputation not: the same honest count as the step
benchmark), and recomputation's cost and agreement on the 7B shape at 2 x 16,384 tokens.
    python3 bench/long_context_results.py RAW_DIR OUT.json
RAW_DIR holds bench/long_context.sh's files (config_q7b.json and config_q05.json are the
models' configs). Exits non-zero when a run is missing or did not train (a non-finite loss).
"""
import datetime, json, math, os, sys

sys.path.insert(0, os.path.dirname(__file__))
from step_results import model_flops

raw, out_path = sys.argv[1:3]
q7, q05 = "config_q7b.json", "config_q05.json"
load = lambda name: json.load(open(os.path.join(raw, name)))
peak = load("gemm_peak.json")["tflops"]
env = open(os.path.join(raw, "env.txt")).read().splitlines()
# bf16's own floor on this GPU: transformers' bf16 against its fp32 on the 0.5B shape
# (bench/hf_parity.py, in the repository's current result).
floor = json.load(open(os.path.join(os.path.dirname(__file__), "results", "hf_parity.json")))["bfloat16"]
floor_logits, floor_grads = floor["hf_dtype_vs_hf_fp32_logits_rel_err"], floor["peft_dtype_vs_peft_fp32_grad_rel_err"]
missing = []


def run(name, model, batch=None):  # model: the name of its config in RAW_DIR
    path = os.path.join(raw, name + ".json")
    if not os.path.exists(path):
        missing.append(name)
        return {"trained": False}
    d = json.load(open(path))
    cfg = load(model)
    lengths = [len(s["tokens"]) for s in load(f"batch_{batch or name}.json")["sequences"]]
    flops, _ = model_flops(cfg, lengths, 2)  # LoRA: forward + input gradients; attention 3x forward
    s = d["worker_step_median_s"]
    losses = d.get("step_losses", [])
    return {"trained": bool(losses) and all(v is not None and math.isfinite(v) for v in losses),
            "sequences": len(lengths), "tokens": sum(lengths), "steps": len(losses), "step_losses": losses,
            "step_s": s, "tokens_per_s": sum(lengths) / s, "peak_gib": d.get("peak_cuda_gib"),
            "mfu": flops / s / 1e12 / peak, "model_tflops": flops / s / 1e12,
            "micro_batches_recomputed": d["last_step_metrics"].get("micro_batches_recomputed:sum", 0),
            "micro_batches_recomputed_selective": d["last_step_metrics"].get("micro_batches_recomputed_selective:sum", 0),
            "micro_batches": d["last_step_metrics"].get("micro_batches:sum")}


rows = {"q7b_32768": run("q7b_32768", q7), "q7b_131072": run("q7b_131072", q7), "q05_131072": run("q05_131072", q05)}
recomputed = {level: run("recompute_" + level, q7, "q7b_2x16384") for level in ("none", "selective", "full")}
result = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": env[0].removeprefix("machine: "),
    "versions": env[-1] if len(env) > 1 else "",
    "command": os.environ.get("BENCH_COMMAND", "python3 scripts/bench.py suite long"),
    "commit": os.environ.get("BENCH_COMMIT", "unknown"),
    "models": "Qwen2.5-7B and Qwen2.5-0.5B shapes written by transformers (random bf16 weights), "
              "YaRN factor 4 over 32,768 positions (131,072)",
    "lora": "r32 alpha 32, all linears; PPO loss; micro-batch = the sequence", "gemm_peak_tflops": peak,
    "mfu_method": "model FLOPs (4 x matmul parameters x tokens + 3 x causal attention forward) / step time / "
                  "measured bf16 GEMM peak; recomputation not counted",
    **rows,
}
if not any(name.startswith("recompute_") for name in missing):
    base = load("recompute_none.json")["first_step"]
    result["recompute_2x16384"] = {"bf16_floor_logits_rel": floor_logits, "bf16_floor_grads_rel": floor_grads,
                                   "none": recomputed["none"]}
    for level in ("selective", "full"):
        got = load(f"recompute_{level}.json")["first_step"]
        lp_a, lp_b = got["logprobs"], base["logprobs"]
        norm = math.sqrt(sum(x * x for x in lp_b)) or 1.0
        r = {"run": recomputed[level],
             "overhead_fraction": recomputed[level]["step_s"] / recomputed["none"]["step_s"] - 1,
             "loss_rel_diff": abs(got["loss"] - base["loss"]) / abs(base["loss"]),
             "grad_norm_rel_diff": abs(got["grad_norm"] - base["grad_norm"]) / abs(base["grad_norm"]),
             "logprobs_rel_diff": math.sqrt(sum((x - y) ** 2 for x, y in zip(lp_a, lp_b))) / norm,
             "logprobs_max_abs_diff": max(abs(x - y) for x, y in zip(lp_a, lp_b))}
        r["within_bf16_floor"] = (r["loss_rel_diff"] <= floor_logits and r["logprobs_rel_diff"] <= floor_logits
                                  and r["grad_norm_rel_diff"] <= floor_grads)
        result["recompute_2x16384"][level] = r
    # Selective: what "auto" picks when activations do not fit and the kept attention does;
    # full (auto's pick when even that does not fit) beside it.
    result["recompute_overhead_fraction"] = result["recompute_2x16384"]["selective"]["overhead_fraction"]
    result["recompute_full_overhead_fraction"] = result["recompute_2x16384"]["full"]["overhead_fraction"]
    result["recompute_overhead_method"] = (
        "(step with every layer selectively recomputed, as auto picks where that fits) / (step without) - 1; "
        "7B shape, 2 x 16,384 tokens, micro-batch 16,384, worker step medians after a warm-up, one call")
result["missing"] = missing
json.dump(result, open(out_path, "w"), indent=2)
print(json.dumps({k: v for k, v in result.items() if k not in ("recompute_2x16384",)}, indent=1)[:3000])
if "recompute_2x16384" in result:
    for level in ("selective", "full"):
        print(level, json.dumps({k: v for k, v in result["recompute_2x16384"][level].items() if k != "run"}))
bad = sorted(set(missing + [k for k, v in rows.items() if not v["trained"]]))
if bad:
    print("long context: not trained or missing:", bad)
    sys.exit(1)
