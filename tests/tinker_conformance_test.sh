#!/usr/bin/env bash
# The Tinker-compatible front against a real coordinator and worker (tests/tinker_conformance_test.py).
set -euo pipefail
pb2=$(mktemp -d)
cp proto/tinker_public_pb2.py "$pb2/"
tmp=$(mktemp -d)
trap 'rm -rf "$pb2" "$tmp"' EXIT
/usr/bin/python3 tests/tinker_conformance_test.py server/lorastep_coordinator worker/lorastep_worker \
  tools/lorastep_genmodel "$pb2" "$tmp"
