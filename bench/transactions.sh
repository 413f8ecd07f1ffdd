#!/usr/bin/env bash
# Issue 27's transaction matrix on CPU meshes (bench/transactions.py), written to
# bench/results/transactions.json: every replicated gradient bucket of TP2, TP2 x PP2 x DP2
# and TP2 x DP2 x EP2 (MoE), skipped, doubled or corrupted on one rank in a run's first
# TrainStep, must be refused before the optimizer with nothing applied on any rank.
#   bash bench/transactions.sh [OUT_JSON] [--quick] [--recovery N] [--recovery_only]
# The recovery trials (--recovery N): rank 1 of a DP2 mesh SIGKILLed mid-step beside two
# CPU-bound processes, the client retrying until its step is applied.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/transactions.json}
bazel build //server:lorastep_coordinator_testing //worker:lorastep_worker_testing //tools:lorastep_genmodel \
  //clients/python:python_client >/dev/null 2>&1 || { echo "build failed"; exit 1; }
PYTHONPATH="$PWD/clients/python:$PWD/bazel-bin/clients/python" /usr/bin/python3 bench/transactions.py \
  ./bazel-bin/server/lorastep_coordinator_testing ./bazel-bin/worker/lorastep_worker_testing \
  ./bazel-bin/tools/lorastep_genmodel "$OUT" "${@:2}"
