#!/usr/bin/env bash
# Many runs on one base model (issue 30): the same concurrent calls against a coordinator whose
# worker co-schedules (--coschedule_window_us, default 5000) and against one that serves them
# one at a time (0). Writes OUT_DIR/NAME_coscheduled.json and OUT_DIR/NAME_one_at_a_time.json;
# bench/multi_tenant_results.py compares them.
#   bench/multi_tenant.sh BIN_DIR MODEL_DIR DEVICE OUT_DIR NAME RUNS SEQS LEN [STEPS]
# BIN_DIR holds lorastep_coordinator, lorastep_worker and multi_tenant (a CMake build folder,
# or bazel-bin). Environment: WINDOW_US (the co-scheduled side's window), RANKS (comma list,
# cycled over the runs), COORD_FLAGS, MACHINE, VERSIONS, BENCH_COMMAND.
set -euo pipefail
BIN=$1 MODEL=$2 DEVICE=$3 OUT=$4 NAME=$5 RUNS=$6 SEQS=$7 LEN=$8 STEPS=${9:-5}
find_bin() { for p in "$BIN/$1" "$BIN/server/$1" "$BIN/worker/$1" "$BIN/bench/$1"; do
  [ -x "$p" ] && { echo "$p"; return; }; done; echo "missing $1" >&2; exit 1; }
VOCAB=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
WORK=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && { kill $PID 2>/dev/null; wait $PID 2>/dev/null || true; }; rm -rf "$WORK"' EXIT
for side in coscheduled one_at_a_time; do
  window=${WINDOW_US:-5000}; [ $side = one_at_a_time ] && window=0
  rm -f "$WORK/port"
  "$(find_bin lorastep_coordinator)" --model "$MODEL" --device "$DEVICE" --port 0 --port_file "$WORK/port" \
    --worker_binary "$(find_bin lorastep_worker)" --coschedule_window_us $window ${COORD_FLAGS:-} 2> "$WORK/$side.log" &
  PID=$!
  for _ in $(seq 1200); do [ -s "$WORK/port" ] && break; sleep 0.1; done
  [ -s "$WORK/port" ] || { cat "$WORK/$side.log"; exit 1; }
  "$(find_bin multi_tenant)" --address "127.0.0.1:$(cat "$WORK/port")" --vocab "$VOCAB" --runs "$RUNS" \
    --seqs "$SEQS" --len "$LEN" --steps "$STEPS" --ranks "${RANKS:-32}" --label "$side (coschedule_window_us $window)" \
    --machine "${MACHINE:-$(uname -n) $(nproc) cores}" --versions "${VERSIONS:-}" --model "$(basename "$MODEL") on $DEVICE" \
    --command "${BENCH_COMMAND:-bench/multi_tenant.sh $*}" --out "$OUT/${NAME}_$side.json" | \
    python3 -c "import json,sys;d=json.load(sys.stdin);print('$NAME $side: %.0f tokens/s, p50 %.3f s, p99 %.3f s, runs per step %.2f' % (d['aggregate_tokens_per_s'], d['latency_p50_s'], d['latency_p99_s'], d['co_scheduled_runs_mean']))"
  kill $PID; wait $PID 2>/dev/null || true; PID=
done
