#!/usr/bin/env bash
# bench/service_overhead refuses an unknown --targets before it connects anywhere, naming the flag.
set -uo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
out=$("$R/bench/service_overhead" --address 127.0.0.1:1 --vocab 10 --targets shifted 2>&1)
rc=$?
[ "$rc" -eq 1 ] || { echo "expected exit 1, got $rc: $out"; exit 1; }
[[ "$out" == *"--targets: shifted is neither next nor random"* ]] || { echo "unexpected message: $out"; exit 1; }
echo "refused as expected: $out"
