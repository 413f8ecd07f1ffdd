#!/usr/bin/env bash
# scripts/bench.py fails loudly (tests/bench_tool_test.py).
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
/usr/bin/python3 "$R/tests/bench_tool_test.py" "$R/scripts/bench.py" "${TEST_TMPDIR:-$(mktemp -d)}"
