#!/usr/bin/env bash
# The Tinker-compatible front against a real coordinator and worker (tests/tinker_conformance_test.py).
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
mkdir -p "$TMP/pb2"
cp "$R/proto/tinker_public_pb2.py" "$TMP/pb2/"
export PYTHONPATH="$R/clients/python"
/usr/bin/python3 "$R/tests/tinker_conformance_test.py" "$R/server/lorastep_coordinator" "$R/worker/lorastep_worker" \
  "$R/tools/lorastep_genmodel" "$TMP/pb2" "$TMP"
