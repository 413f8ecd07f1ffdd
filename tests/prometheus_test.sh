#!/usr/bin/env bash
# The Prometheus endpoints of a real coordinator and worker (tests/prometheus_test.py).
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
export PYTHONPATH="$R/clients/python"
/usr/bin/python3 "$R/tests/prometheus_test.py" "$R/server/lorastep_coordinator" "$R/worker/lorastep_worker" \
  "$R/tools/lorastep_genmodel" "$TMP"
