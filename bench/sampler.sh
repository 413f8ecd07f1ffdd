#!/usr/bin/env bash
# The sampler's CPU figures (bench/sampler_bench.cc says what each is), written with the
# date, machine, library versions and command to bench/results/sampler.json (or OUT_JSON);
# a "gpu" entry already there (the GPU suite's sampler_gpu.json) is kept.
#   bash bench/sampler.sh [OUT_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/sampler.json}
bazel build //bench:sampler_bench > /dev/null 2>&1 || { echo "build failed"; exit 1; }
LINES=$(./bazel-bin/bench/sampler_bench)
echo "$LINES"
python3 - "$OUT" <<PY
import datetime, json, platform, subprocess, sys
lines = """$LINES""".split()
figures = {k: float(v) for k, v in (l.split("=", 1) for l in lines)}
ver = lambda p: subprocess.run(["dpkg-query", "-W", "-f=\${Version}", p], capture_output=True, text=True).stdout
out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "machine": f"{platform.node()} ({__import__('os').cpu_count()} cores, {platform.platform()})",
       "library_versions": {"libtorch": ver("libtorch-dev")},
       "command": "bash bench/sampler.sh",
       "workload": "tiny Qwen2-shaped model, fp32 on CPU, LoRA r8 on every linear and the LM head (random factors)"}
out.update({k: (int(v) if k in ("same_seed_identical", "cpu_parity_tokens") else v) for k, v in figures.items()})
try:  # the GPU figures (scripts/bench.py suite sampler) stay, with their own date and machine
    out["gpu"] = json.load(open(sys.argv[1]))["gpu"]
except (OSError, KeyError, ValueError):
    pass
json.dump(out, open(sys.argv[1], "w"), indent=2)
print("wrote", sys.argv[1])
PY
