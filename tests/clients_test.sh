#!/usr/bin/env bash
# Starts a real coordinator (+ its local worker) on a generated tiny model, then runs the
# Python client test, the example loop and the CLI against it.
set -euo pipefail
R="${TEST_SRCDIR:-$PWD}/lorastep"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
"$R/tools/lorastep_genmodel" --preset tiny --out "$TMP/model" >/dev/null

"$R/server/lorastep_coordinator" --model "$TMP/model" --port 0 --port_file "$TMP/port" \
  --worker_binary "$R/worker/lorastep_worker" --allow_plain_paths &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
/usr/bin/python3 "$R/tests/wait_for.py" "$TMP/port"
PORT=$(cat "$TMP/port")
export PYTHONPATH="$R/clients/python:$(dirname "$R")/lorastep/clients/python"
/usr/bin/python3 "$R/tests/python_client_test.py" "127.0.0.1:$PORT" "$TMP"
/usr/bin/python3 "$R/clients/python/examples/grpo_loop.py" --address "127.0.0.1:$PORT" \
  --vocab 96 --steps 4 | tee "$TMP/grpo.txt"
GRPO_RUN=$(awk '/^run /{print $2; exit}' "$TMP/grpo.txt")
# The Python client installed with pip from the repository (offline, Debian's setuptools;
# setup.py generates lorastep/v1 from proto/), and the SFT example (async calls) on it.
SRC="$TMP/src"
mkdir -p "$SRC/clients" && cp -rL "$R/clients/python" "$SRC/clients/" && cp -rL "$R/proto" "$SRC/"
chmod -R u+w "$SRC" && rm -rf "$SRC/clients/python/lorastep/v1"  # pip must generate its own
PIP_ROOT_USER_ACTION=ignore /usr/bin/python3 -m pip install -q --disable-pip-version-check --no-build-isolation \
  --no-deps --no-index --target "$TMP/pip" "$SRC/clients/python"
(cd "$TMP" && PYTHONPATH="$TMP/pip" /usr/bin/python3 -c \
  "import lorastep, lorastep.v1.trainer_pb2 as t; assert lorastep.__file__.startswith('$TMP/pip'), lorastep.__file__")
PYTHONPATH="$TMP/pip" /usr/bin/python3 "$SRC/clients/python/examples/sft_loop.py" --address "127.0.0.1:$PORT" \
  --data "$TMP/sft.jsonl" --make_data 64 --epochs 3
# Whether a command succeeds and its whole output (stdout and stderr) matches a pattern. Not
# `cmd | grep -q`: grep exits at its first match, and under pipefail a command still writing
# then dies of SIGPIPE and fails the test.
outputs() {
  local pattern=$1 out
  shift
  out=$("$@" 2>&1) || { echo "failed: $*"; echo "$out"; return 1; }
  grep -q -- "$pattern" <<< "$out" || { echo "no '$pattern' in the output of: $*"; echo "$out"; return 1; }
}
# The CLI against the same coordinator.
CLI="$R/clients/cli/lorastep --address 127.0.0.1:$PORT"
outputs "^run-1 " $CLI runs
# absl flags: --help, unknown flags and flags of another command are errors.
outputs "plot --run R" $R/clients/cli/lorastep --help
if $CLI --bogus_flag runs 2> "$TMP/e0.txt"; then echo "unknown flag accepted"; exit 1; fi
grep -q "Unknown command line flag 'bogus_flag'" "$TMP/e0.txt"
if $CLI runs --target_modules q_proj 2> "$TMP/e1.txt"; then echo "inapplicable flag accepted"; exit 1; fi
grep -q "\-\-target_modules does not apply to 'runs'" "$TMP/e1.txt"
if $CLI frob 2> "$TMP/e2.txt"; then echo "unknown command accepted"; exit 1; fi
grep -q "unknown command 'frob'" "$TMP/e2.txt"
for i in 0 1 2 3; do
  echo '{"tokens":[1,2,3,4,5,6],"target_tokens":[2,3,4,5,6,7],"logprobs":[-4,-4,-4,-4,-4,-4],"advantages":[0,1,1,1,1,'"$((i % 2))"']}'
done > "$TMP/data.jsonl"
RUN=$($CLI create --rank 4 --alpha 8)
# Tinker's switches: LoRA on the LM head too; a bad value names the flag.
$CLI create --rank 4 --alpha 8 --train_attn false --train_unembed true --json > "$TMP/head.json"
grep -q '"lm_head"' "$TMP/head.json"
if grep -q '"q_proj"' "$TMP/head.json"; then echo "train_attn false ignored"; exit 1; fi
if $CLI create --train_unembed yes 2> "$TMP/e3.txt"; then echo "bad switch accepted"; exit 1; fi
grep -q -- "--train_unembed: 'yes' is not true or false" "$TMP/e3.txt"
# The API's defaults (cross_entropy, no clipping) apply: a plain dataset trains.
$CLI train --run "$RUN" --data "$TMP/data.jsonl" --batch 2 --lr 1e-3 | tee "$TMP/train.txt"
[ "$(grep -c '^ *[0-9]' "$TMP/train.txt")" = 2 ] || { echo "expected 2 train steps"; exit 1; }
$CLI train --run "$RUN" --data "$TMP/data.jsonl" --batch 4 --loss ppo --lr 1e-3 --json > "$TMP/train.json"
/usr/bin/python3 - "$TMP/train.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert r["learner_version"] == "3" or r["learner_version"] == 3, r
assert "ppo_kl:mean" in r["metrics"], r["metrics"]  # --loss ppo reached the server
assert len(repr(r["metrics"]["loss:sum"])) > 10, r["metrics"]["loss:sum"]  # full precision
PY
outputs '"logprobs"' $CLI forward --run "$RUN" --data "$TMP/data.jsonl"
outputs '"metrics"' $CLI forward-backward --run "$RUN" --data "$TMP/data.jsonl"
outputs "^ *3 *4 " $CLI optim-step --run "$RUN" --lr 1e-3 --names loss:sum,grad_norm:sum
$CLI metrics --run "$RUN" --names loss:sum,grad_norm:sum | tee "$TMP/metrics.txt"
[ "$(grep -c '^ *[0-9]' "$TMP/metrics.txt")" = 4 ] || { echo "expected 4 metric rows"; exit 1; }
$CLI watch --run "$RUN" --count 2 > "$TMP/watch.txt"
[ "$(grep -c '^ *[0-9]' "$TMP/watch.txt")" = 2 ] || { echo "watch: expected 2 rows"; exit 1; }
outputs "^$RUN " $CLI top --iterations 1
outputs '"learner_version"' $CLI get --run "$RUN"
# sample: completions as JSON, the learner version sampled; a bad id refused naming it.
$CLI sample --run "$RUN" --prompts "1,2,3;4,5" --num_samples 2 --max_tokens 4 --seed 7 > "$TMP/sample.json"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert len(r['prompts'])==2 and all(len(p['sequences'])==2 and all(len(s['tokens'])==4 for s in p['sequences']) for p in r['prompts']) and int(r['learner_version'])>0, r" "$TMP/sample.json"
# top shows sampling beside training: one Sample call, 2 prompts x 2 samples x 4 tokens.
$CLI top --iterations 1 > "$TMP/top.txt"
grep -q "sample_tok/s" "$TMP/top.txt"
awk -v run="$RUN" '$1 == run && $5 == 1 && $6 == 16 { found = 1 } END { exit !found }' "$TMP/top.txt" \
  || { echo "top: expected 1 Sample call and 16 sampled tokens for $RUN"; cat "$TMP/top.txt"; exit 1; }
if $CLI sample --run "$RUN" --prompts "1,x" 2> "$TMP/e4.txt"; then echo "bad prompt accepted"; exit 1; fi
grep -q "'x' is not a token id" "$TMP/e4.txt"
outputs "sha256" $CLI export --run "$RUN" --path "$TMP/cli-peft"
# plot: the example loop's run (it sent client:reward and client:mismatch_max)
$CLI plot --run "$GRPO_RUN" --out "$TMP/run.png" | tee "$TMP/plot.txt"
grep -q "train/sample log-prob mismatch" "$TMP/plot.txt"
if command -v gnuplot > /dev/null; then
  grep -q "written to $TMP/run.png" "$TMP/plot.txt"
  head -c 8 "$TMP/run.png" | od -An -tx1 | grep -q "89 50 4e 47"
fi
echo '{"tokens":[1,2],"target_tokens":[2]}' > "$TMP/bad.jsonl"
if $CLI train --run "$RUN" --data "$TMP/bad.jsonl" 2> "$TMP/err.txt"; then echo "bad data accepted"; exit 1; fi
grep -q "datums\[0\].target_tokens: length" "$TMP/err.txt"
echo '{"tokens":[1,2],"bogus":[2]}' > "$TMP/bad2.jsonl"
if $CLI train --run "$RUN" --data "$TMP/bad2.jsonl" 2> "$TMP/err2.txt"; then echo "unknown field accepted"; exit 1; fi
grep -q "line 1: unknown field bogus" "$TMP/err2.txt"
if $CLI train --run "$RUN" --data "$TMP/data.jsonl" --lr fast 2> "$TMP/err3.txt"; then echo "bad number accepted"; exit 1; fi
grep -q "\-\-lr: 'fast' is not a number" "$TMP/err3.txt"
outputs "deleted $RUN" $CLI delete --run "$RUN"
echo "cli: 1 passed, 0 failed"
# A TP2 x PP2 x DP2 mesh of 8 CPU worker processes behind a second coordinator.
"$R/server/lorastep_coordinator" --model "$TMP/model" --port 0 --port_file "$TMP/port8" \
  --worker_binary "$R/worker/lorastep_worker" --tp 2 --pp 2 --dp 2 --collective_timeout_s 60 &
PID8=$!
trap 'kill $PID $PID8 2>/dev/null; wait $PID $PID8 2>/dev/null || true' EXIT
/usr/bin/python3 "$R/tests/wait_for.py" "$TMP/port8"
/usr/bin/python3 "$R/tests/python_mesh_test.py" "127.0.0.1:$(cat "$TMP/port8")"
