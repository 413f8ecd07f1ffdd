#!/usr/bin/env bash
# Issue 11's two-GPU runs (nvidia-h200-x2, NCCL, bf16), after scripts/bench.py's CMake
# build (`python3 scripts/bench.py suite multi-gpu` runs it). Every run is a real coordinator starting its
# own workers (rank r on cuda:r) and bench/mesh_trace driving it over gRPC:
#   dense, the Qwen2.5-0.5B shape, LoRA r32 on all linears, 64 x 512 (bench/make_batch.py):
#     world 1; world 1 computing in fp32 (--dtype float32: the same bf16 weights; the
#     tolerance's floor, how far bf16 itself is from the exact result); DP2; TP2; PP2; and a
#     worker killed mid-step on DP2
#   MoE, shared-outer expert LoRA r32, EP2 (experts over the 2 data-parallel ranks) against
#     world 1 (and its fp32 floor): the tiny Qwen2-MoE (bf16) and the reduced Qwen3-30B-A3B shape
# then bench/multi_gpu_results.py compares the traces and writes OUT_DIR/multi_gpu.json.
# A failed run is reported and the others go on; the script then fails.
#   bench/multi_gpu.sh BUILD_DIR OUT_DIR    (DEVICE=cpu runs the same on gloo, tiny models)
set -euo pipefail
BIN=$1 OUT=$2 ARGS="$*"
DEVICE=${DEVICE:-cuda}
TRACES=$OUT/multi_gpu_raw; mkdir -p "$TRACES"
STEPS=${MULTI_STEPS:-6}
find_bin() { for p in "$BIN/$1" "$BIN/server/$1" "$BIN/worker/$1" "$BIN/tools/$1" "$BIN/bench/$1"; do
  [ -x "$p" ] && { echo "$p"; return; }; done; echo "missing $1" >&2; exit 1; }
GEN=$(find_bin lorastep_genmodel) COORD=$(find_bin lorastep_coordinator) WORKER=$(find_bin lorastep_worker)
TRACE=$(find_bin mesh_trace)
DENSE=${DENSE_PRESET:-qwen2.5-0.5b} MOE_BIG=${MOE_BIG_PRESET:-qwen3-30b-a3b-reduced}
source "$(dirname "$0")/gen_model.sh"
gen() { gen_model "$GEN" "$@"; }  # preset dtype folder
FAILED=
gen "$DENSE" bfloat16 /tmp/mg_dense
gen tiny-moe bfloat16 /tmp/mg_tiny_moe
vocab() { python3 -c "import json,sys;print(json.load(open(sys.argv[1]+'/config.json'))['vocab_size'])" "$1"; }
python3 bench/make_batch.py --vocab "$(vocab /tmp/mg_dense)" --workload fixed --out "$TRACES/batch_dense.json"
python3 bench/make_batch.py --vocab "$(vocab /tmp/mg_tiny_moe)" --workload fixed --out "$TRACES/batch_tiny.json"

COORD_PID=
start_coord() {  # model-folder log coordinator-flags...; sets PORT (plain paths: traces export to /tmp)
  local model=$1 log=$2; shift 2
  rm -f /tmp/mg_port
  "$COORD" --model "$model" --device "$DEVICE" --port 0 --port_file /tmp/mg_port --worker_binary "$WORKER" \
    --collective_timeout_s 30 --allow_plain_paths ${EXTRA_COORD_FLAGS:-} "$@" 2> "$log" &
  COORD_PID=$!
  for _ in $(seq 1800); do [ -s /tmp/mg_port ] && break; kill -0 $COORD_PID 2>/dev/null || break; sleep 0.1; done
  [ -s /tmp/mg_port ] || { echo "coordinator did not start: $*"; tail -20 "$log"; return 1; }
  PORT=$(cat /tmp/mg_port)
}
stop_coord() {
  [ -n "$COORD_PID" ] || return 0
  kill $COORD_PID 2>/dev/null || true
  wait $COORD_PID 2>/dev/null || true
  COORD_PID=
}
trap stop_coord EXIT

wanted() { [ -z "${MULTI_RUNS:-}" ] || [[ " $MULTI_RUNS " == *" $1 "* ]]; }  # MULTI_RUNS: a subset
trace() {  # name model batch expert_lora max_tokens coordinator-flags...
  local name=$1 model=$2 batch=$3 expert=$4 mt=$5; shift 5
  wanted "$name" || return 0
  start_coord "$model" "$TRACES/$name.coordinator.log" "$@" || { FAILED="$FAILED $name"; return 0; }
  rm -rf "/tmp/mg_export_$name"
  timeout "${TRACE_TIMEOUT:-180}" "$TRACE" --address "127.0.0.1:$PORT" --batch_file "$batch" --rank 32 --alpha 32 --expert_lora "$expert" \
    --steps "$STEPS" --max_tokens "$mt" --export_dir "/tmp/mg_export_$name" --label "$name: $*" \
    --out "$TRACES/$name.json" 2> "$TRACES/$name.log" || { echo "$name failed"; tail -5 "$TRACES/$name.log"; FAILED="$FAILED $name"; }
  echo "$name ($*): $(grep -c replicas_equal "$TRACES/$name.log") steps, last: $(tail -1 "$TRACES/$name.log")"
  stop_coord
}

results() {
  python3 bench/multi_gpu_results.py "$TRACES" "$OUT/multi_gpu.json" --machine "${MACHINE:-$(uname -n)}" \
    --versions "${VERSIONS:-}" --command "${MULTI_COMMAND:-bench/multi_gpu.sh $ARGS}"
}

MT=${MULTI_MAX_TOKENS:-8192}
trace dense_w1 /tmp/mg_dense "$TRACES/batch_dense.json" "" $MT
trace dense_w1_fp32 /tmp/mg_dense "$TRACES/batch_dense.json" "" $MT --dtype float32
trace dense_dp2 /tmp/mg_dense "$TRACES/batch_dense.json" "" $MT --dp 2
trace dense_tp2 /tmp/mg_dense "$TRACES/batch_dense.json" "" $MT --tp 2
trace dense_pp2 /tmp/mg_dense "$TRACES/batch_dense.json" "" $MT --pp 2
# A worker killed mid-step: DP2, rank 1's worker SIGKILLed KILL_AFTER_MS into a TrainStep.
if wanted kill_dp2; then
  start_coord /tmp/mg_dense "$TRACES/kill.coordinator.log" --dp 2 --peer_failure_grace_s 10 || FAILED="$FAILED kill_dp2"
fi
if wanted kill_dp2 && [ -n "$COORD_PID" ]; then
  timeout 120 "$TRACE" --address "127.0.0.1:$PORT" --batch_file "$TRACES/batch_dense.json" --rank 32 --max_tokens $MT \
    --kill_cmd "pkill -KILL -P $COORD_PID -f -- '--rank 1 '" --kill_after_ms "${KILL_AFTER_MS:-100}" \
    --label "dp2, rank 1 killed mid-step" --out "$TRACES/kill_dp2.json" 2> "$TRACES/kill_dp2.log" \
    || { echo "kill run failed"; tail -5 "$TRACES/kill_dp2.log"; FAILED="$FAILED kill_dp2"; }
  stop_coord
fi
trace tiny_moe_w1 /tmp/mg_tiny_moe "$TRACES/batch_tiny.json" shared_outer $MT
trace tiny_moe_w1_fp32 /tmp/mg_tiny_moe "$TRACES/batch_tiny.json" shared_outer $MT --dtype float32
trace tiny_moe_ep2 /tmp/mg_tiny_moe "$TRACES/batch_tiny.json" shared_outer $MT --dp 2 --ep 2
results > /dev/null
if [ -z "${SKIP_MOE_BIG:-}" ] && wanted moe_w1; then
  MOE_MT=${MULTI_MOE_MAX_TOKENS:-16384}
  gen "$MOE_BIG" bfloat16 /tmp/mg_moe_big
  trace moe_w1 /tmp/mg_moe_big "$TRACES/batch_dense.json" shared_outer $MOE_MT
  trace moe_w1_fp32 /tmp/mg_moe_big "$TRACES/batch_dense.json" shared_outer $MOE_MT --dtype float32
  trace moe_ep2 /tmp/mg_moe_big "$TRACES/batch_dense.json" shared_outer $MOE_MT --dp 2 --ep 2
fi

results
[ -z "$FAILED" ] || { echo "failed:$FAILED"; exit 1; }
