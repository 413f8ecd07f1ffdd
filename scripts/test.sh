#!/usr/bin/env bash
# Installs dependencies (Debian 12) and runs every test with Bazel, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests always run (the disk cache would otherwise replay earlier results).
bazel test //... --test_output=errors --nocache_test_results "$@"
