#!/usr/bin/env bash
# Many runs on one base model (issue 30): the same concurrent calls against a coordinator whose
# worker co-schedules (--coschedule_window_us, default 5000) and against one that serves them
# one at a time (0). Writes OUT_DIR/NAME_coscheduled.json and OUT_DIR/NAME_one_at_a_time.json;
# bench/multi_tenant_results.py compares them.
#   bench/multi_tenant.sh BIN_DIR MODEL_DIR DEVICE OUT_DIR NAME RUNS SEQS LEN [STEPS]
# BIN_DIR holds lorastep_coordinator, lorastep_worker and multi_tenant (a CMake build folder,
# or bazel-bin). Environment: WINDOW_US (the co-scheduled side's window), RANKS (comma list,
# cycled over the runs), COORD_FLAGS, MT_FLAGS (more flags for the multi_tenant client), MACHINE, VERSIONS, BENCH_COMMAND, PROFILE (non-empty:
# afterwards one more short pass per side, its second step traced with Kineto and summarized
# by bench/profile_summary.py into OUT_DIR/profile_NAME_SIDE.json, its PROFILE_TOP kernels, default
# 20, listed; the timed passes run untraced), HOP_TRACE (a folder: each timed side's processes
# write their hop timestamps to HOP_TRACE/NAME_SIDE, lib/hop_trace.h; bench/hop_timeline.py
# reads them).
set -euo pipefail
BIN=$1 MODEL=$2 DEVICE=$3 OUT=$4 NAME=$5 RUNS=$6 SEQS=$7 LEN=$8 STEPS=${9:-5}
find_bin() { for p in "$BIN/$1" "$BIN/server/$1" "$BIN/worker/$1" "$BIN/bench/$1"; do
  [ -x "$p" ] && { echo "$p"; return; }; done; echo "missing $1" >&2; exit 1; }
VOCAB=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
mkdir -p "$OUT"
WORK=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && { kill $PID 2>/dev/null; wait $PID 2>/dev/null || true; }; rm -rf "$WORK"' EXIT
sides="coscheduled one_at_a_time"
[ -n "${PROFILE:-}" ] && sides="$sides coscheduled_profiled one_at_a_time_profiled"
for side in $sides; do
  window=${WINDOW_US:-5000}; [ ${side%_profiled} = one_at_a_time ] && window=0
  steps=$STEPS result="$OUT/${NAME}_$side.json" trace=
  if [ "$side" != "${side%_profiled}" ]; then  # the worker traces each run's second step
    steps=1 result="$WORK/${NAME}_$side.json" trace="$WORK/${NAME}_$side.trace.json"
  fi
  rm -f "$WORK/port"
  hops=
  if [ -n "${HOP_TRACE:-}" ] && [ "$side" = "${side%_profiled}" ]; then hops="$HOP_TRACE/${NAME}_$side"; mkdir -p "$hops"; fi
  export LORASTEP_HOP_TRACE_DIR=$hops
  LORASTEP_PROFILE_TRACE=$trace LORASTEP_PROFILE_STEP=2 \
  "$(find_bin lorastep_coordinator)" --model "$MODEL" --device "$DEVICE" --port 0 --port_file "$WORK/port" \
    --worker_binary "$(find_bin lorastep_worker)" --coschedule_window_us $window ${COORD_FLAGS:-} 2> "$WORK/$side.log" &
  PID=$!
  for _ in $(seq 1200); do [ -s "$WORK/port" ] && break; sleep 0.1; done
  [ -s "$WORK/port" ] || { cat "$WORK/$side.log"; exit 1; }
  "$(find_bin multi_tenant)" --address "127.0.0.1:$(cat "$WORK/port")" --vocab "$VOCAB" --runs "$RUNS" \
    --seqs "$SEQS" --len "$LEN" --steps "$steps" --ranks "${RANKS:-32}" --label "$side (coschedule_window_us $window)" \
    --machine "${MACHINE:-$(uname -n) $(nproc) cores}" --versions "${VERSIONS:-}" --model "$(basename "$MODEL") on $DEVICE" \
    --command "${BENCH_COMMAND:-bench/multi_tenant.sh $*}" --out "$result" ${MT_FLAGS:-} | \
    python3 -c "import json,sys;d=json.load(sys.stdin);print('$NAME $side: %.0f tokens/s, p50 %.3f s, p99 %.3f s, runs per step %.2f' % (d['aggregate_tokens_per_s'], d['latency_p50_s'], d['latency_p99_s'], d['co_scheduled_runs_mean']))"
  kill $PID; wait $PID 2>/dev/null || true; PID=
  if [ -n "$trace" ]; then
    [ -s "$trace" ] || { echo "no trace from $side" >&2; tail -5 "$WORK/$side.log" >&2; exit 1; }
    python3 "$(dirname "$0")/profile_summary.py" "$trace" --top "${PROFILE_TOP:-20}" --label "$NAME $side: one traced step ($RUNS runs x $SEQS x $LEN)" \
      --machine "${MACHINE:-$(uname -n)}" --command "${BENCH_COMMAND:-bench/multi_tenant.sh $*} (PROFILE=1)" \
      --out "$OUT/profile_${NAME}_${side%_profiled}.json" | tail -3
  fi
done
