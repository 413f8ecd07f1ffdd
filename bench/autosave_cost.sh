#!/usr/bin/env bash
# What autosaves cost the step, side by side in one run: the same LoRA TrainSteps through a
# coordinator without a journal (none), with a journal that autosaves every step on the
# step's path (sync: --noautosave_in_background), and with background autosaves every step
# (background: the default). The variants alternate ROUNDS times, so drift hits all alike.
#   bench/autosave_cost.sh BIN_DIR PRESET DEVICE DTYPE OUT_DIR
# Environment: as bench/service_overhead.sh (MODEL_DIR, BATCH_FILE, RANK, MACHINE,
# VERSIONS, IN_PROCESS_WORKER), STEPS per run (default 8), ROUNDS (default 2), COORD_FLAGS.
# Writes OUT_DIR/autosave_<variant>_<round>.json (service_overhead's fields), .server.log (the
# coordinator's and workers' stderr) and, per run with
# a journal, OUT_DIR/autosave_<variant>_<round>.store.txt: the autosave folder's size and the
# highest autosave number the journal names (autosaves started).
set -euo pipefail
BIN=$1 PRESET=$2 DEVICE=$3 DTYPE=$4 OUT=$5
mkdir -p "$OUT"
for round in $(seq "${ROUNDS:-2}"); do
  for variant in none sync background; do
    STORE=$(mktemp -d)
    case $variant in
      none) flags="" ;;
      sync) flags="--state_dir $STORE --autosave_every_steps 1 --noautosave_in_background" ;;
      background) flags="--state_dir $STORE --autosave_every_steps 1" ;;
    esac
    STEPS=${STEPS:-8} COORD_FLAGS="${COORD_FLAGS:-} $flags" SERVER_LOG="$OUT/autosave_${variant}_$round.server.log" \
      bench/service_overhead.sh "$BIN" "$PRESET" "$DEVICE" "$DTYPE" "$OUT/autosave_${variant}_$round.json" \
      overhead_fraction > /dev/null 2> "$OUT/autosave_${variant}_$round.log"
    if [ "$variant" != none ]; then
      { du -sb "$STORE"/runs/*/autosave-* 2>/dev/null | tail -1 | cut -f1 | sed 's/^/autosave_bytes /'
        cat "$STORE"/.journal/*/journal | grep -ao 'autosave-[0-9]*' | sed 's/autosave-//' | sort -n | tail -1 |
          sed 's/^/autosaves_started /'; } > "$OUT/autosave_${variant}_$round.store.txt"
    fi
    rm -rf "$STORE"
  done
done
