#!/usr/bin/env bash
# The CPU parallel-equivalence suite as a result file: runs tests/mesh_test (real worker
# processes on c10d gloo, tiny model, fp32) and writes bench/results/parallel.json with the
# largest relative error of each layout against world size 1 (loss, grad_norm, Forward
# log-probs, exported adapter), cpu_world8_max_rel_err (TP2 x PP2 x DP2) and replicas_equal
# (every mesh step), plus date, machine, library versions and the command.
#   bash bench/parallel_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/parallel.json}
RAW=$(mktemp)
bazel test //tests:mesh_test --nocache_test_results --test_env=LORASTEP_PARALLEL_JSON="$RAW" \
  --test_output=errors
/usr/bin/python3 - "$RAW" "$OUT" <<'PY'
import json, platform, subprocess, sys, datetime
raw = json.load(open(sys.argv[1]))
def pkg(name):
    try:
        return subprocess.check_output(["dpkg-query", "-W", "-f=${Version}", name], text=True)
    except Exception:
        return "unknown"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
out = {
    "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": f"{platform.node()} ({cpu}, {subprocess.check_output(['nproc'], text=True).strip()} cores), {platform.platform()}",
    "versions": {"libtorch": pkg("libtorch-dev"), "gloo": pkg("libgloo-dev"), "grpc": pkg("libgrpc++-dev")},
    "command": "bash bench/parallel_cpu.sh",
    "what": "3 optimizer steps (PPO, micro-batches of <= 24 tokens, AdamW eps 1e-3, grad clip) on the "
            "tiny model, fp32, each layout against world size 1; max relative error over loss, grad_norm, "
            "Forward log-probs and the exported adapter",
}
out.update(raw)
json.dump(out, open(sys.argv[2], "w"), indent=2)
print(json.dumps(out, indent=2))
PY
