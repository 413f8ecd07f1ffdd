"""The 7B-class LoRA step of bench/step7b.sh as figures: tokens/s, MFU against the bf16 GEMM
peak measured in the same call, and peak memory, for lorastep and transformers + PEFT, and
the three ratios issue 28 asks for.
    python3 bench/step7b_results.py RAW_DIR MODEL_DIR OUT.json
"""
import json, os, sys

sys.path.insert(0, os.path.dirname(__file__))
from step_results import model_flops  # the same honest FLOP count as the 0.5B step

raw, model, out_path = sys.argv[1:4]
load = lambda name: json.load(open(os.path.join(raw, name)))
cfg = json.load(open(os.path.join(model, "config.json")))
lengths = [len(s["tokens"]) for s in load("batch_fixed_7b.json")["sequences"]]
flops, matmul_params = model_flops(cfg, lengths, 2)  # LoRA: forward + input gradients
peak = load("gemm_peak.json")["tflops"]
ours, hf = load("ours_lora_7b.json"), load("hf_lora_7b.json")
env = open(os.path.join(raw, "env.txt")).read().splitlines()
tokens = sum(lengths)
rows = {}
for side, seconds, gib in (("lorastep", ours["worker_step_median_s"], ours.get("peak_cuda_gib")),
                           ("transformers_peft", hf["step_s"], hf["peak_memory_gib"])):
    rows[side] = {"step_s": seconds, "tokens_per_s": tokens / seconds, "model_tflops": flops / seconds / 1e12,
                  "mfu": flops / seconds / 1e12 / peak, "peak_cuda_gib": gib}
result = {
    "date": hf["date"], "machine": env[0].removeprefix("machine: "), "versions": env[-1] if len(env) > 1 else "",
    "command": os.environ.get("BENCH_COMMAND", "python3 scripts/bench.py suite step7b"),
    "commit": os.environ.get("BENCH_COMMIT", "unknown"),
    "model": "Qwen2.5-7B shape written by transformers (random bf16 weights, its shards and index)",
    "matmul_parameters": matmul_params, "batch": "64 x 512 tokens", "lora": "r32 alpha 32, all linears",
    "lorastep_micro_batch_tokens": 8192, "gemm_peak_tflops": peak, "rows": rows,
    "lora_7b_tokens_per_s_over_peft": rows["lorastep"]["tokens_per_s"] / rows["transformers_peft"]["tokens_per_s"],
    "lora_7b_mfu": rows["lorastep"]["mfu"],
    "lora_7b_peak_over_peft": (rows["lorastep"]["peak_cuda_gib"] or float("nan")) / rows["transformers_peft"]["peak_cuda_gib"],
}
for name in sorted(os.listdir(raw)):  # other micro-batch sizes (STEP7B_MBS)
    if name.startswith("ours_lora_7b_mb"):
        d = load(name)
        s = d["worker_step_median_s"]
        result["rows"]["lorastep_mb" + name[len("ours_lora_7b_mb"):-len(".json")]] = {
            "step_s": s, "tokens_per_s": tokens / s, "mfu": flops / s / 1e12 / peak, "peak_cuda_gib": d.get("peak_cuda_gib")}
json.dump(result, open(out_path, "w"), indent=2)
print(json.dumps({k: v for k, v in result.items() if k.startswith("lora_7b") or k == "rows"}, indent=1))
