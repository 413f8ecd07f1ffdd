#!/usr/bin/env bash
# API keys and run ownership on a real coordinator (tests/auth_test.py).
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
export PYTHONPATH="$R/clients/python"
/usr/bin/python3 "$R/tests/auth_test.py" "$R/server/lorastep_coordinator" "$R/worker/lorastep_worker" \
  "$R/tools/lorastep_genmodel" "$R/clients/cli/lorastep" "$TMP"
