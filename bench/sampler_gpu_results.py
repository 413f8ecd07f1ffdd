"""Joins bench/sampler_gpu.sh's raw files into OUT/sampler_gpu.json: per shape and batch,
lorastep's tokens/s (the whole call, and decode-only steps) against transformers `generate`
(the whole call), their ratio, the roofline fraction of lorastep's median decode step; the
cost of 8 adapters in a batch of 64 against one, the gain of sharing a prompt's prefill over
16 samples, and the bf16 train/sample log-prob mismatch. With the date, machine, versions,
commit and command (the environment bench.py sets: MACHINE, VERSIONS, BENCH_COMMAND, BENCH_COMMIT).
    python3 bench/sampler_gpu_results.py OUT "0.5b 7b" PROMPT NEW
"""
import datetime, json, os, sys


def main():
    out, shapes, prompt, new = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), int(sys.argv[4])
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": os.environ.get("MACHINE", "unknown"),
        "library_versions": os.environ.get("VERSIONS", ""),
        "commit": os.environ.get("BENCH_COMMIT", ""),
        "command": os.environ.get("BENCH_COMMAND", "bash bench/sampler_gpu.sh"),
        "workload": (f"random Qwen2.5-shaped models in bf16, LoRA r16 on q,k,v,o,gate,up,down (random factors), "
                     f"prompts of {prompt} random tokens, {new} new tokens each, one sample per prompt, "
                     f"temperature 1, nothing cut; transformers generate (SDPA) with the same PEFT adapter shape"),
        "shapes": {},
    }
    for shape in shapes:
        ours = {}
        for line in open(os.path.join(out, f"sampler_ours_{shape}.txt")):
            if "=" in line:
                k, v = line.strip().split("=", 1)
                ours[k] = float(v)
        hf = json.load(open(os.path.join(out, f"sampler_hf_{shape}.json")))
        rows = {}
        keys = [k for k in ours if k.endswith("_tokens_per_s") and not k.endswith("decode_tokens_per_s")]
        for key in sorted(keys, key=lambda k: int(k[1:].split("_")[0])):
            b = key[1:].split("_")[0]
            theirs = hf.get(f"b{b}_tokens_per_s")
            rows[f"batch_{b}"] = {
                "ours_tokens_per_s": ours[key],
                "ours_decode_tokens_per_s": ours[f"b{b}_decode_tokens_per_s"],
                "ours_decode_step_ms": ours[f"b{b}_decode_step_ms"],
                "ours_roofline_fraction": ours[f"b{b}_roofline_fraction"],
                "transformers_tokens_per_s": theirs,
                "speedup": round(ours[key] / theirs, 3) if theirs else None,
            }
        result["shapes"][shape] = {
            "batches": rows,
            "copy_bandwidth_gbs": ours["copy_bandwidth_gbs"],
            "weight_bytes": int(ours["weight_bytes"]),
            "kv_bytes_per_position": int(ours["kv_bytes_per_position"]),
            "bf16_mismatch_max": ours.get("mismatch_max"),
            "bf16_mismatch_mean": ours.get("mismatch_mean"),
            "bf16_mismatch_batch": int(ours.get("mismatch_batch", 0)),
            "adapters8_cost_fraction": round(ours["adapters8_wall_s"] / ours["adapters1_wall_s"] - 1, 4),
            "adapters_new_tokens": int(ours["side_new_tokens"]),
            "prefix16_speedup": round(ours["separate16_wall_s"] / ours["prefix16_wall_s"], 3),
            "raw_ours": ours,
            "raw_transformers": hf,
        }
    json.dump(result, open(os.path.join(out, "sampler_gpu.json"), "w"), indent=1)
    print(json.dumps({s: {b: (r["ours_tokens_per_s"], r["transformers_tokens_per_s"], r["speedup"],
                              r["ours_roofline_fraction"]) for b, r in v["batches"].items()}
                      for s, v in result["shapes"].items()}))


if __name__ == "__main__":
    main()
