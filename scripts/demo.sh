#!/usr/bin/env bash
# The main job, from a fresh Debian 12 machine: installs dependencies, builds, starts a
# coordinator with one local worker on a generated small Qwen2-shaped model, runs the
# example GRPO loop (Python client: rollouts sampled through the service, a verifiable
# reward, PPO on the sampler's log-probs) for a few real RL steps, shows the
# step metrics with the CLI, exports the adapter, plots the run's curves (PNG through
# gnuplot, and a terminal sketch) and shuts everything down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel build //server:lorastep_coordinator //worker:lorastep_worker //tools:lorastep_genmodel \
  //clients/cli:lorastep //clients/python:python_client
WORK=${WORKDIR:-/tmp/lorastep-demo}
rm -rf "$WORK" && mkdir -p "$WORK"
./bazel-bin/tools/lorastep_genmodel --preset small --seed 1 --out "$WORK/model"
# Checkpoints and exports live in the server's state store, named lorastep://<run>/<name>.
./bazel-bin/server/lorastep_coordinator --model "$WORK/model" --port 0 --state_dir "$WORK/state" \
  --port_file "$WORK/port" 2> "$WORK/server.log" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$WORK/port" ] && break; sleep 0.1; done
ADDRESS=127.0.0.1:$(cat "$WORK/port")
echo "coordinator + local worker serving on $ADDRESS"
PYTHONPATH="$PWD/clients/python:$PWD/bazel-bin/clients/python" /usr/bin/python3 \
  clients/python/examples/grpo_loop.py --address "$ADDRESS" --vocab 512 --steps "${STEPS:-8}" \
  --export "lorastep://run-1/adapter"
echo
echo "step metrics kept by the coordinator (lorastep metrics):"
./bazel-bin/clients/cli/lorastep --address "$ADDRESS" metrics --run run-1 \
  --names client:reward,client:mismatch_max,loss:sum,grad_norm:sum,entropy:mean,tokens_per_s:sum
echo
echo "the run's curves (lorastep plot; the loop sent its reward and the train/sample mismatch):"
./bazel-bin/clients/cli/lorastep --address "$ADDRESS" plot --run run-1 --out "$WORK/run-1.png"
kill $PID && wait $PID 2>/dev/null || true
trap - EXIT
echo "coordinator and worker stopped"
