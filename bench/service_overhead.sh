#!/usr/bin/env bash
# Starts a coordinator + local worker on a generated model and measures service overhead.
#   bench/service_overhead.sh BIN_DIR PRESET DEVICE DTYPE OUT_JSON KEY
# BIN_DIR holds lorastep_coordinator, lorastep_worker, lorastep_genmodel, service_overhead
# (a CMake build folder; for Bazel pass bazel-bin and the script finds the subfolders).
# Environment: MODEL_DIR (a generated model), RANK (0 = full fine-tuning), MAX_TOKENS,
# STEPS, SEQS, LEN, EXPERT_LORA, BATCH_FILE (bench/make_batch.py), MODE (train|forward),
# PACKED (true: datums as packed_datums, the client's default; false: repeated Datum),
# COORD_FLAGS (extra coordinator flags, e.g. --max_tokens_per_microbatch N for Forward),
# CLIENT_FLAGS (extra service_overhead flags), IN_PROCESS_WORKER (true: lorastep_coordinator_with_worker --in_process_worker, the worker in
# the coordinator's process; BIN_DIR must hold that binary too), SERVER_CPUS and CLIENT_CPUS
# (taskset CPU lists: the coordinator, with the worker it spawns, and the client pinned there).
set -euo pipefail
BIN=$1 PRESET=$2 DEVICE=$3 DTYPE=$4 OUT=$5 KEY=$6
find_bin() { for p in "$BIN/$1" "$BIN/server/$1" "$BIN/worker/$1" "$BIN/tools/$1" "$BIN/bench/$1"; do
  [ -x "$p" ] && { echo "$p"; return; }; done; echo "missing $1" >&2; exit 1; }
WORK=$(mktemp -d)
# SERVER_LOG: keep the coordinator's and workers' stderr there (with COORD_FLAGS=--v=2, every
# call's duration on each side, for splitting the overhead).
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true; [ -n "${SERVER_LOG:-}" ] && cp "$WORK/server.log" "$SERVER_LOG"; rm -rf "$WORK"' EXIT
MODEL=${MODEL_DIR:-$WORK/model}  # MODEL_DIR: an already generated model of PRESET/DTYPE
[ -n "${MODEL_DIR:-}" ] || "$(find_bin lorastep_genmodel)" --preset "$PRESET" --dtype "$DTYPE" --seed 1 --out "$MODEL" >/dev/null
VOCAB=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
COORDINATOR=lorastep_coordinator
if [ "${IN_PROCESS_WORKER:-false}" = true ]; then COORDINATOR=lorastep_coordinator_with_worker WORKER_FLAGS=--in_process_worker
else WORKER_FLAGS="--worker_binary $(find_bin lorastep_worker)"; fi
${SERVER_CPUS:+taskset -c $SERVER_CPUS} "$(find_bin $COORDINATOR)" --model "$MODEL" --device "$DEVICE" --port 0 \
  --port_file "$WORK/port" $WORKER_FLAGS ${COORD_FLAGS:-} 2> "$WORK/server.log" &
PID=$!
for _ in $(seq 1200); do [ -s "$WORK/port" ] && break; sleep 0.1; done
[ -s "$WORK/port" ] || { cat "$WORK/server.log"; exit 1; }
${CLIENT_CPUS:+taskset -c $CLIENT_CPUS} "$(find_bin service_overhead)" --address "127.0.0.1:$(cat "$WORK/port")" --vocab "$VOCAB" \
  --seqs "${SEQS:-64}" --len "${LEN:-512}" --steps "${STEPS:-5}" --out "$OUT" --key "$KEY" \
  --rank "${RANK:-32}" --max_tokens "${MAX_TOKENS:-0}" --expert_lora "${EXPERT_LORA:-}" \
  ${BATCH_FILE:+--batch_file "$BATCH_FILE"} --mode "${MODE:-train}" --packed="${PACKED:-true}" --server_pid $PID ${CLIENT_FLAGS:-} \
  --machine "${MACHINE:-$(uname -n) $(nproc) cores}" --versions "${VERSIONS:-}" \
  --model "$PRESET $DTYPE on $DEVICE" --command "bench/service_overhead.sh $*"
