#!/usr/bin/env bash
# Starts a real coordinator (+ its local worker) on a generated tiny model, then runs the
# Python client test and the example loop against it.
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
"$R/tools/lorastep_genmodel" --preset tiny --out "$TMP/model" >/dev/null
"$R/server/lorastep_coordinator" --model "$TMP/model" --port 0 --port_file "$TMP/port" \
  --worker_binary "$R/worker/lorastep_worker" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$TMP/port" ] && break; sleep 0.1; done
PORT=$(cat "$TMP/port")
export PYTHONPATH="$R/clients/python:$(dirname "$R")/lorastep/clients/python"
/usr/bin/python3 "$R/tests/python_client_test.py" "127.0.0.1:$PORT" "$TMP"
/usr/bin/python3 "$R/clients/python/examples/grpo_loop.py" --address "127.0.0.1:$PORT" \
  --vocab 96 --steps 4
