#!/usr/bin/env bash
# The Tinker-compatible front's figures (CPU, one run): the conformance test's cases and its
# gRPC twin, the front's added time per 64 x 512 training step against the gRPC API, and the
# coordinator's memory and threads with 1,000 idle long-polls. Writes bench/results/tinker_front.json.
#   bash bench/tinker_front.sh [--steps N] [--polls N]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results/tinker_front.json
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
bazel build //server:lorastep_coordinator //worker:lorastep_worker //tools:lorastep_genmodel \
  //clients/python:python_client //proto:tinker_py_gen >/dev/null 2>&1
export PYTHONPATH="bazel-bin/clients/python:bazel-bin/proto"
mkdir -p "$W/conformance" "$W/pb2" "$W/cost"
cp bazel-bin/proto/tinker_public_pb2.py "$W/pb2/"
/usr/bin/python3 tests/tinker_conformance_test.py bazel-bin/server/lorastep_coordinator bazel-bin/worker/lorastep_worker \
  bazel-bin/tools/lorastep_genmodel "$W/pb2" "$W/conformance" > "$W/conformance.log" 2>&1 || true
if ! /usr/bin/python3 bench/tinker_front.py bazel-bin/server/lorastep_coordinator bazel-bin/worker/lorastep_worker \
  bazel-bin/tools/lorastep_genmodel "$W/cost" "$@" > "$W/cost.log" 2>&1; then
  tail -n 30 "$W/cost.log" "$W/cost/coordinator.log" >&2
  exit 1
fi
/usr/bin/python3 - "$W/conformance.log" "$W/cost.log" "$OUT" "$*" <<'PY'
import datetime, json, os, platform, re, subprocess, sys
log = open(sys.argv[1]).read() + open(sys.argv[2]).read()
def figure(name, kind=float):
    found = re.findall(r"^" + name + r"=(.+)$", log, re.M)
    if not found:
        raise SystemExit(f"no {name} in the logs:\n{log[-3000:]}")
    return kind(found[-1])
ver = lambda p: subprocess.run(["dpkg-query", "-W", "-f=${Version}", p], capture_output=True, text=True).stdout
out = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
       "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.platform()})",
       "library_versions": {"libtorch": ver("libtorch-dev"), "grpc": ver("libgrpc++-dev"),
                            "libmicrohttpd": ver("libmicrohttpd-dev"), "libzstd": ver("libzstd-dev")},
       "command": ("bash bench/tinker_front.sh " + sys.argv[4]).strip(),
       "workload": "tiny generated model on CPU, LoRA r8; a step = forward_backward (cross_entropy) of 64 datums x 512 "
                   "tokens + optim_step",
       "conformance_cases": figure("conformance_cases", int),
       "conformance_passed": figure("conformance_passed", int),
       "conformance_failed": re.findall(r"^case (\S+): FAILED", log, re.M),
       "bitwise_equal_to_grpc": figure("bitwise_equal_to_grpc", str) == "true",
       "step_front_s": figure("step_front_s"), "step_grpc_s": figure("step_grpc_s"),
       "step_front_all_s": json.loads(figure("step_front_all_s", str)),
       "step_grpc_all_s": json.loads(figure("step_grpc_all_s", str)),
       "overhead_fraction": figure("overhead_fraction"),
       "overhead_fraction_per_step": json.loads(figure("overhead_fraction_per_step", str)),
       "front_submit_s": figure("front_submit_s"),
       "idle_polls": figure("idle_polls", int),
       "idle_polls_answered_early": figure("idle_polls_answered_early", int),
       "rss_before_polls_mb": figure("rss_before_polls_mb"), "rss_with_polls_mb": figure("rss_with_polls_mb"),
       "peak_rss_mb": figure("peak_rss_mb"),
       "threads_before_polls": figure("threads_before_polls", int),
       "threads_with_polls": figure("threads_with_polls", int)}
json.dump(out, open(sys.argv[3], "w"), indent=2)
print(json.dumps(out, indent=2))
PY
