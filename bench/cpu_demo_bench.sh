#!/usr/bin/env bash
# Issue 9's CPU figure: the README demo's train step (coordinator + local worker on CPU, the
# `small` preset, 64 sequences x 63 tokens, LoRA r16) as model FLOP/s, against an at::mm fp32
# peak measured in the same run on the same cores. Prints both; writes OUT_JSON.
#   bench/cpu_demo_bench.sh [OUT_JSON]   (after: bazel build //bench:all //server:all //worker:all //tools:all)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/cpu_demo.json}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
./bazel-bin/bench/mm_peak --out "$WORK/mm.json"
RANK=16 SEQS=64 LEN=63 STEPS=${STEPS:-5} bash bench/service_overhead.sh bazel-bin small cpu float32 "$WORK/demo.json" overhead_fraction_cpu_demo \
  > /dev/null 2>&1 || { echo "demo step failed"; exit 1; }
python3 - "$WORK/mm.json" "$WORK/demo.json" "$OUT" <<'PY'
import json, sys, datetime, platform, os, subprocess
mm = json.load(open(sys.argv[1])); demo = json.load(open(sys.argv[2]))
m = demo["last_step_metrics"]
flops = m["model_flops:sum"] / m["time_step_s:sum"] / 1e9
ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libtorch-dev"], capture_output=True, text=True).stdout
out = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
       "machine": f"{platform.node()} ({os.cpu_count()} cores)", "library_versions": {"libtorch": ver},
       "command": "bash bench/cpu_demo_bench.sh",
       "workload": "README demo shape: small preset (4 layers, H 128, vocab 512), 64 x 63 tokens, LoRA r16, PPO, fp32, CPU",
       "demo_model_gflops": flops, "demo_step_s": m["time_step_s:sum"], "demo_worker_step_s_all": demo["worker_step_s"],
       "mm_peak_gflops": mm["mm_peak_gflops"], "mm_peak": mm,
       "cpu_demo_flops_fraction": flops / mm["mm_peak_gflops"],
       "phases_s": {k: v for k, v in m.items() if k.startswith("time_")}}
json.dump(out, open(sys.argv[3], "w"), indent=2)
print(f"demo step {out['demo_step_s']:.3f} s, model {flops:.2f} GFLOP/s; at::mm peak {mm['mm_peak_gflops']:.2f} GFLOP/s; fraction {out['cpu_demo_flops_fraction']:.3f}")
PY
