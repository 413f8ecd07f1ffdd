#!/usr/bin/env bash
# Installs dependencies (Debian 12) and runs every test with Bazel, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_layering.sh
log=$(mktemp)
# Tests always run (the disk cache would otherwise replay earlier results).
set +e
bazel test //... --test_output=errors --nocache_test_results "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
passed=$(grep -cE '^//[^ ]+ +PASSED' "$log" || true)
failed=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log" || true)
rm -f "$log"
echo "${passed} passed, ${failed} failed"
exit "$rc"
