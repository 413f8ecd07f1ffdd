"""Writes bench/results/moe.json for the MoE issue from the raw files of one device run and
the CPU mesh suite:
  - GPU (`python3 scripts/bench.py suite moe-parity moe-bench` on nvidia-h200):
    moe_hf_fwdbwd.json (bench/peft_step.py --mode fwdbwd: transformers' own forward +
    backward of the reduced Qwen3-30B-A3B shape, no optimizer) and moe_ours_<layout>_<mt>.json
    (bench/service_overhead.sh: lorastep LoRA r32 train steps through coordinator + worker),
    both 64 x 512 tokens, bf16, the same generated safetensors;
  - CPU (`bash bench/parallel_cpu.sh`): bench/results/parallel.json with
    cpu_world8_moe_max_rel_err, seed_failure_caught and the seed's hashes.
    python3 bench/moe_results.py GPU_DIR [bench/results/parallel.json] [bench/results/moe.json]
"""
import glob, json, os, statistics, sys


def main():
    gpu = sys.argv[1]
    cpu_path = sys.argv[2] if len(sys.argv) > 2 else "bench/results/parallel.json"
    out_path = sys.argv[3] if len(sys.argv) > 3 else "bench/results/moe.json"
    hf = json.load(open(os.path.join(gpu, "moe_hf_fwdbwd.json")))
    tokens = 64 * 512
    ours = {}
    for path in sorted(glob.glob(os.path.join(gpu, "moe_ours_*.json"))):
        d = json.load(open(path))
        name = os.path.basename(path)[len("moe_ours_"):-len(".json")]
        step = statistics.median(d["worker_step_s"])
        m = d.get("last_step_metrics", {})
        ours[name] = {
            "step_s_median": step, "step_s_all": d["worker_step_s"], "tokens_per_s": tokens / step,
            "fwd_bwd_s": m.get("time_forward_s:sum", 0) + m.get("time_backward_s:sum", 0),
            "phase_s": {k: v for k, v in m.items() if k.startswith("time_")},
            "mfu_reported": m.get("mfu:sum"), "routing": {k: v for k, v in m.items() if k.startswith("moe_")},
            "batch": d["batch"], "command": d["command"], "date": d["date"],
        }
    best = max(ours.values(), key=lambda o: o["tokens_per_s"])
    cpu = json.load(open(cpu_path))
    out = {
        "date": best["date"][:10],
        "machine": "nvidia-h200 (device tool): " + json.load(open(glob.glob(os.path.join(gpu, "moe_ours_*.json"))[0]))["machine"]
                   + "; CPU figures: " + cpu.get("machine", "?"),
        "versions": {"gpu": best and json.load(open(glob.glob(os.path.join(gpu, "moe_ours_*.json"))[0]))["library_versions"],
                     "cpu": cpu.get("versions")},
        "command": os.environ.get("BENCH_COMMAND", "python3 scripts/bench.py suite moe-parity moe-bench")
                   + "; bash bench/parallel_cpu.sh; python3 bench/moe_results.py GPU_OUT",
        "what": "reduced Qwen3-30B-A3B shape (H 2048, 128 experts, top-8, moe width 768, 4 layers, vocab "
                "151936), bf16, 64 x 512 random tokens: lorastep LoRA r32 (all linear, expert LoRA) train "
                "step (forward, backward, finalization, AdamW, digest) against transformers' own forward + "
                "backward of the same safetensors (micro-batch 8 sequences, no optimizer)",
        "lorastep_moe_lora_tokens_per_s": best["tokens_per_s"],
        "hf_moe_tokens_per_s": hf["tokens_per_s"],
        "ratio_lorastep_over_hf": best["tokens_per_s"] / hf["tokens_per_s"],
        "target_ratio": 2.0,
        "hf": hf,
        "lorastep": ours,
        "cpu_world8_moe_max_rel_err": cpu["cpu_world8_moe_max_rel_err"],
        "seed_failure_caught": cpu["seed_failure_caught"],
        "seed_hashes": cpu.get("seed_hashes"),
        "cpu_tolerance": cpu.get("tolerance"),
    }
    json.dump(out, open(out_path, "w"), indent=2)
    print(json.dumps({k: out[k] for k in ("lorastep_moe_lora_tokens_per_s", "hf_moe_tokens_per_s",
                                          "ratio_lorastep_over_hf", "cpu_world8_moe_max_rel_err",
                                          "seed_failure_caught")}, indent=2))


if __name__ == "__main__":
    main()
