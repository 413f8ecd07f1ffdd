#!/usr/bin/env bash
# Installs dependencies (Debian 12), builds, and runs a local GRPO-style LoRA training demo
# through lib/ on a generated small model: a metrics table per step, then a PEFT adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel build //tools:lorastep_demo
./bazel-bin/tools/lorastep_demo --steps "${STEPS:-8}" --workdir "${WORKDIR:-/tmp/lorastep-demo}"
