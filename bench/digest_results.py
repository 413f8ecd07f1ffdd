#!/usr/bin/env python3
"""The finalizer's digest check beside the LoRA step, from one call of scripts/bench.py (suites step, digest).

digest_results.py DIGEST_JSON STEP_JSON ENV_TXT OUT_JSON
DIGEST_JSON: bench/digest_cost's output (one TP2 rank's checked buckets hashed on the GPU).
STEP_JSON: the step benchmark's single-GPU LoRA row (ours_lora_fixed.json, 64 x 512).
Writes both figures, their ratio and the versions to OUT_JSON, and prints the ratio.
"""
import json
import sys

digest_path, step_path, env_path, out_path = sys.argv[1:5]
digest = json.load(open(digest_path))
step = json.load(open(step_path))
env = open(env_path).read().splitlines()
step_ms = 1000.0 * step["worker_step_median_s"]
out = {
    "date": digest["date"],
    "machine": env[0].removeprefix("machine: ") if env else digest["machine"],
    "versions": env[-1] if len(env) > 1 else "",
    "libtorch": digest["libtorch"],
    "command": digest["command"],
    "what": "SHA-256 (device kernels) of every gradient bucket rank 0 of tp2 compares after its reductions, "
            "0.5B shape, LoRA r32 on all linears; beside the single-GPU LoRA step (64 x 512, bf16) of the same call",
    "layout": digest["layout"],
    "buckets": digest["buckets"],
    "bytes_hashed": digest["bytes_hashed"],
    "check_median_ms": digest["check_median_ms"],
    "check_min_ms": digest["check_min_ms"],
    "check_max_ms": digest["check_max_ms"],
    "lora_step_median_ms": step_ms,
    "check_share_of_step": digest["check_median_ms"] / step_ms,
}
json.dump(out, open(out_path, "w"), indent=2)
print(f"digest check {digest['check_median_ms']:.3f} ms over {digest['bytes_hashed'] / 1e6:.1f} MB; "
      f"LoRA step {step_ms:.1f} ms; share {100 * out['check_share_of_step']:.3f}%")
