#!/usr/bin/env bash
# Installs dependencies (Debian 12) and runs every test with Bazel, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel test //... --test_output=errors "$@"
