#!/usr/bin/env bash
# Reliability figures on this machine, written to bench/results/reliability.json:
#  - load: bench/load_test (16 clients, one run each, 10,000 small TrainSteps against one
#    coordinator + local worker on the tiny model, CPU, journal on: every step autosaved in
#    the background): throughput, p99 step, fairness,
#    server RSS growth after a 500-step warm-up, runs whose learner_version lost a step;
#  - faults: the fault tests, each injecting one fault in real processes or files (a worker
#    SIGKILLed mid-call on a mesh, a SIGKILLed coordinator (and one restarted from its journal),
#    a SIGKILLed worker restarted with its runs, a hung worker against deadlines, SIGTERM with a
#    stream open, a full disk, a crash in the middle of a save, SIGKILLed ranks of listed and
#    registered meshes that come back, registered workers replaced) -> faults_survived;
#  - bad inputs: tests/fuzz_test's mutated files and requests -> bad_inputs_tried.
# state_lost = runs that lost a step under load + fault tests that failed.
# Fault and figure tests that fail are counted in the figures (fault_tests_failed, state_lost,
# the transaction paths), not fatal; anything else that fails stops the script.
#   bash bench/reliability.sh [OUT_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/reliability.json}
STEPS=${LOAD_STEPS:-10000} CLIENTS=${LOAD_CLIENTS:-16}
bazel build //bench:load_test //server:lorastep_coordinator //worker:lorastep_worker //tools:lorastep_genmodel \
  //clients/python:python_client >/dev/null 2>&1 || { echo "build failed"; exit 1; }
W=$(mktemp -d); PID=; trap '[ -z "$PID" ] || { kill $PID 2>/dev/null; wait $PID 2>/dev/null; }; rm -rf "$W"' EXIT
./bazel-bin/tools/lorastep_genmodel --preset tiny --seed 1 --out "$W/model" >/dev/null
# With a state dir: the journal on, every step of every run autosaved (in the background).
./bazel-bin/server/lorastep_coordinator --model "$W/model" --port 0 --port_file "$W/port" --state_dir "$W/state" \
  --worker_binary ./bazel-bin/worker/lorastep_worker 2> "$W/server.log" &
PID=$!
for _ in $(seq 300); do [ -s "$W/port" ] && break; sleep 0.2; done
WPID=$(pgrep -P $PID | head -1)
./bazel-bin/bench/load_test --address "127.0.0.1:$(cat "$W/port")" --vocab 96 --clients "$CLIENTS" \
  --total_steps "$STEPS" --warmup_steps 500 --pids "$PID,$WPID" --out "$W/load.json" > /dev/null
kill $PID; wait $PID 2>/dev/null || true; PID=
FAULTS="//tests:process_test:ProcessTest.* //tests:registration_test:RegistrationTest.* //tests:file_util_test:FileUtilTest.FullDiskIsResourceExhausted:CheckpointDirTest.* //tests:trainer_test:TrainerTest.InterruptedSaveLeavesThePreviousCheckpointLoadable //tests:mesh_test:MeshTest.KilledWorkerFailsTheCallNamingTheRankAndNothingIsApplied //tests:run_journal_test:RunJournalIntegrityTest.*"
passed=0 failed=0
for spec in $FAULTS; do
  target=${spec%%:[A-Z]*}; filter=${spec#"$target":}
  log=$(bazel test "$target" --test_filter="$filter" --test_output=all --cache_test_results=no 2>&1 || true)
  passed=$((passed + $(grep -c '^\[       OK \]' <<< "$log" || true)))
  failed=$((failed + $(grep -c '^\[  FAILED  \] [A-Za-z]*\.[A-Za-z]* (' <<< "$log" || true)))
  [ "$target" = "//tests:process_test" ] && echo "$log" > "$W/process_tests.log"
done
fuzz=$( (bazel test //tests:fuzz_test --test_output=all --cache_test_results=no 2>&1 || true) | { grep -o 'bad_inputs_tried [a-z]* [0-9]*' || true; } | awk '{s += $3} END {print s + 0}')
# Issue 26's figures, as the tests that check them print them: unauthenticated paths tried
# and accepted, the coordinator's peak RSS under three 63 MB unauthenticated requests
# (tests/auth_test.py), journal damage cases and silent rollbacks (tests/run_journal_test.cc),
# the time from an abandoned 2M-token TrainStep's deadline to another run's answered step
# (ProcessTest.AbandonedCallStopsAtTheNextMicroBatchAndAppliesNothing; on a DP2 mesh,
# ProcessTest.AbandonedMeshCallStopsOnEveryRankAtTheSameMicroBatch).
bazel test //tests:auth_test //tests:run_journal_test --test_output=all --cache_test_results=no > "$W/issue26.log" 2>&1 || true
cat "$W/process_tests.log" >> "$W/issue26.log"
# Issue 55's figures: tenants (bench/tenant_isolation.py: a greedy key at its limits while
# another key steps; 64 MiB bodies from 16 threads for 30 s), the security policy's table,
# oversized meshes refused before any worker starts, a rank-local LoadState refusal on TP2,
# every collective path refused by one rank (its transaction_path lines); disconnect_to_idle_s
# and mesh_disconnect_to_idle_s come from process_test above.
bazel test //tests:security_policy_test //tests:startup_test --test_output=all --cache_test_results=no >> "$W/issue26.log" 2>&1 || true
bazel test //tests:mesh_test --test_filter='MeshTest.LoadStateRefused*:MeshTest.EveryCollectivePath*' --test_output=all --cache_test_results=no \
  >> "$W/issue26.log" 2>&1 || true
mkdir -p "$W/tenants"
PYTHONPATH=bazel-bin/clients/python /usr/bin/python3 bench/tenant_isolation.py bazel-bin/server/lorastep_coordinator \
  bazel-bin/worker/lorastep_worker bazel-bin/tools/lorastep_genmodel "$W/tenants" >> "$W/issue26.log" 2>&1
python3 - "$W/load.json" "$OUT" "$passed" "$failed" "$fuzz" "$W/issue26.log" <<'PY'
import datetime, json, os, platform, re, subprocess, sys
load = json.load(open(sys.argv[1])); passed, failed, fuzz = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
log = open(sys.argv[6]).read()
def figure(name, kind=float):
    found = re.findall(r"(?<!\w)" + name + r"=([0-9.]+)", log)
    return kind(found[-1]) if found else None
ver = lambda p: subprocess.run(["dpkg-query", "-W", "-f=${Version}", p], capture_output=True, text=True).stdout
out = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
       "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.platform()})",
       "library_versions": {"libtorch": ver("libtorch-dev"), "grpc": ver("libgrpc++-dev")},
       "command": "bash bench/reliability.sh",
       "workload": "tiny model on CPU; each client: its own run, TrainSteps of 4 x 16 tokens (PPO, LoRA r4); journal on (--state_dir), every step autosaved in the background",
       "concurrent_clients": load["concurrent_clients"], "total_steps": load["total_steps"],
       "steps_per_s": load["steps_per_s"], "p50_step_s": load["p50_step_s"], "p99_step_s": load["p99_step_s"],
       "fairness_min_over_max": load["fairness_min_over_max"], "steps_per_client": load["steps_per_client"],
       "rss_growth_mb": load["rss_growth_mb"], "rss_warm_mb": load["rss_warm_mb"], "rss_end_mb": load["rss_end_mb"],
       "faults_survived": passed, "fault_tests_failed": failed, "bad_inputs_tried": fuzz,
       "state_lost": load["runs_with_lost_state"] + failed, "load_errors": load["errors"],
       "unauthenticated_paths_tried": figure("unauthenticated_paths_tried", int),
       "unauthenticated_paths_accepted": figure("unauthenticated_paths_accepted", int),
       "preauth_peak_rss_mb": figure("preauth_peak_rss_mb"),
       "authenticated_peak_rss_mb": figure("authenticated_peak_rss_mb"),
       "journal_damage_cases": figure("journal_damage_cases", int),
       "journal_silent_rollbacks": figure("journal_silent_rollbacks", int),
       "cancel_to_idle_s": figure("cancel_to_idle_s"),
       "mesh_cancel_to_idle_s": figure("mesh_cancel_to_idle_s"),
       "pipeline_cancel_to_idle_s": figure("pipeline_cancel_to_idle_s"),
       "tenant_lockout_cases": figure("tenant_lockout_cases", int),
       "tenant_lockouts": figure("tenant_lockouts", int),
       "tenant_lockout_rule": "a case is a lockout when the other key gets RESOURCE_EXHAUSTED or its p99 step passes 2x its p99 alone",
       "other_key_p99_alone_s": figure("other_p99_alone_s"),
       "tenant_flood_p99_ratio": figure("tenant_flood_p99_ratio"),
       "tenant_flood_rule": "the greedy key sends TrainSteps that cannot apply (duplicate sequence ids, refused at once) as fast as its client can; the other key's p99 loaded over alone (not a key at its limits: outside tenant_lockouts)",
       "queued_bytes_peak_rss_mb": figure("queued_bytes_peak_rss_mb"),
       "disconnect_to_idle_s": figure("disconnect_to_idle_s"),
       "mesh_disconnect_to_idle_s": figure("mesh_disconnect_to_idle_s"),
       "load_state_refusal_s": figure("load_state_refusal_s"),
       "security_policy_cases": figure("security_policy_cases", int),
       "security_policy_open": figure("security_policy_open", int),
       "oversized_mesh_refused_s": figure("oversized_mesh_refused_s")}
out["tenant_cases"] = re.findall(r"^case .*$", log, re.M)
# A path fails when its answer took 5 s or more, or when any check under its trace failed.
paths = {name: float(s) for name, s in re.findall(r"^transaction_path (.+) ([0-9.]+)$", log, re.M)}
traced = set(re.findall(r"Google Test trace:\n[^\n]*mesh_test\.cc:\d+: (.+)$", log, re.M))
out["transaction_paths"] = len(paths | {n: 0 for n in traced})
out["transaction_path_failures"] = len({n for n, s in paths.items() if s >= 5} | traced)
out["transaction_path_seconds"] = paths
json.dump(out, open(sys.argv[2], "w"), indent=2)
print(json.dumps(out, indent=2))
PY
