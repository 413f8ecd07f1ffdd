#!/usr/bin/env python3
"""A mesh call is a transaction (issue 27): the fault matrix on real CPU meshes.

For each layout and each replicated gradient bucket reduced on it, one coordinator of the
testing build (gloo, one worker process per rank) runs a run's first TrainStep with one fault
in that bucket's reduction: skipped on every rank, reduced twice, or its sums changed on one
rank after the reduction (--test_grad_fault, which strikes each worker's first step only).
Each case records the answer's code and the ranks that applied the step. A rank applied it
when the run's adapter changed: the adapter exported before the faulty call and after it
must be bitwise equal (same SHA-256), and the next, correct TrainStep of the same batch must
succeed with every replica family equal (a rank that had applied alone would differ from
its replicas) and the same adapter as a twin run (same seed) that never saw a fault.

Then the recovery trials: a DP2 mesh with a journal, a run with two steps autosaved, rank 1
SIGKILLed in the middle of a longer step while two CPU-bound processes run beside the mesh;
the client retries the step every second until it is applied. Each trial records the time
from the kill to the applied step.

  python3 bench/transactions.py COORDINATOR_TESTING WORKER_TESTING GENMODEL OUT_JSON [--quick] [--recovery N] [--recovery_only]
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from lorastep import LorastepError, TrainingClient

# (layout flags, model preset, the buckets reduced over a group of two or more ranks there)
LAYOUTS = [
    (["--tp", "2"], "tiny", ["replicated_partial"]),
    (["--tp", "2", "--pp", "2", "--dp", "2"], "tiny", ["replicated_partial", "split"]),
    (["--tp", "2", "--dp", "2", "--ep", "2"], "tiny-moe", ["expert_replicated_partial", "replicated_partial", "split"]),
]
FAILURES = {"skip": "skip", "double": "double", "corrupt": "corrupt:1"}


def debian_version(package):
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True).stdout


def datum(i, n=8, vocab=96):
    return {"tokens": [(i * 7 + j * 3) % vocab for j in range(n)],
            "target_tokens": [(i * 5 + j) % vocab for j in range(n)]}


def batch():
    return [datum(i) for i in range(8)]


def wait_port(path, proc, timeout=180):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}")
        if os.path.exists(path) and open(path).read().strip():
            return int(open(path).read())
        time.sleep(0.1)
    raise RuntimeError("coordinator did not start")


def stop(proc):
    """SIGTERM, then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def exported_sha(run, folder):
    return run.export(folder).adapter_sha256


def run_case(coordinator, worker, model, layout, bucket, failure, tmp):
    port_file = os.path.join(tmp, "port")
    if os.path.exists(port_file):
        os.remove(port_file)
    fault = f"{bucket}:{FAILURES[failure]}"
    with open(os.path.join(tmp, "coordinator.log"), "w") as log:
        proc = subprocess.Popen([coordinator, "--model", model, "--worker_binary", worker, "--port", "0",
                                 "--port_file", port_file, "--allow_plain_paths", "--collective_timeout_s", "60",
                                 "--test_grad_fault", fault] + layout, stderr=log)
    case = {"layout": " ".join(layout), "bucket": bucket, "failure": failure, "fault_flag": fault}
    try:
        client = TrainingClient(f"127.0.0.1:{wait_port(port_file, proc)}")
        run = client.create_run(rank=4, alpha=8, seed=11)
        before = exported_sha(run, os.path.join(tmp, "before"))
        t0 = time.time()
        try:
            run.train_step(batch(), adamw={"lr": 1e-2})
            case["code"] = "OK"
        except LorastepError as e:
            case["code"], case["message"] = e.code.name, e.details[:300]
        case["answer_s"] = round(time.time() - t0, 3)
        after = exported_sha(run, os.path.join(tmp, "after"))
        version = client.get_run(run.run_id).learner_version
        twin = client.create_run(rank=4, alpha=8, seed=11)
        twin_step = twin.train_step(batch(), adamw={"lr": 1e-2})
        retried = run.train_step(batch(), adamw={"lr": 1e-2})
        case["learner_version_after"] = version
        case["export_unchanged"] = before == after
        case["next_call_ok"] = retried.learner_version == version + 1
        case["next_replicas_equal"] = retried.replicas_equal
        case["next_equals_twin"] = retried.adapter_sha256 == twin_step.adapter_sha256
        applied = []
        if not (case["export_unchanged"] and retried.replicas_equal and case["next_equals_twin"]):
            # Name the ranks whose copy differs from its replicas after the next step.
            for h in retried.replica_hashes:
                if not h.equal:
                    applied += list(h.ranks)
            applied = sorted(set(applied)) or ["unknown"]
        case["ranks_that_applied"] = applied
        client.close()
    except Exception as e:  # a case that could not run is recorded, never dropped
        case.setdefault("code", "ERROR")
        case["error"] = str(e)[:300]
        case["ranks_that_applied"] = ["unknown"]
    finally:
        stop(proc)
    return case


def recovery_trial(coordinator, worker, model, tmp, trial):
    port_file = os.path.join(tmp, f"rport{trial}")
    with open(os.path.join(tmp, f"recovery{trial}.log"), "w") as log:
        proc = subprocess.Popen([coordinator, "--model", model, "--worker_binary", worker, "--port", "0",
                                 "--port_file", port_file, "--dp", "2", "--state_dir", os.path.join(tmp, f"state{trial}"),
                                 "--collective_timeout_s", "20", "--peer_failure_grace_s", "5"], stderr=log)
    try:
        client = TrainingClient(f"127.0.0.1:{wait_port(port_file, proc)}", timeout=120)
        run = client.create_run(rank=4, alpha=8, seed=11)
        for _ in range(2):
            run.train_step(batch(), adamw={"lr": 1e-3})
        for _ in range(600):  # the autosave of step 2 is durable
            if (client.get_run(run.run_id).autosaved_learner_version or 0) >= 2:
                break
            time.sleep(0.05)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        long_batch = [datum(i, n=512) for i in range(128)]
        long_step = {}
        failed = threading.Thread(target=lambda: _record(long_step, lambda: run.train_step(long_batch, adamw={"lr": 1e-3})))
        failed.start()
        time.sleep(0.5)
        os.kill(int(ranks[1]), 9)
        killed = time.time()
        failed.join()
        for attempt in range(120):
            try:
                step = run.train_step(batch(), adamw={"lr": 1e-3})
                return {"recovered": True, "seconds": round(time.time() - killed, 3), "attempts": attempt + 1,
                        "killed_mid_step": long_step.get("code") not in (None, "OK"),
                        "learner_version": step.learner_version}
            except LorastepError:
                time.sleep(1)
        return {"recovered": False, "seconds": round(time.time() - killed, 3), "attempts": 120}
    except Exception as e:
        return {"recovered": False, "error": str(e)[:300]}
    finally:
        stop(proc)


def recovery_summary(trials):
    times = sorted(t["seconds"] for t in trials if t.get("recovered"))
    return {"workload": "DP2 tiny model, journal on, rank 1 SIGKILLed 0.5 s into a 128 x 512 TrainStep, two "
                        "CPU-bound processes beside the mesh; the client retries every second",
            "runs": len(trials), "recovered": len(times),
            "median_s": times[len(times) // 2] if times else None, "worst_s": times[-1] if times else None,
            "trials": trials}


def _record(outcome, fn):
    try:
        fn()
        outcome["code"] = "OK"
    except LorastepError as e:
        outcome["code"] = e.code.name


def main():
    coordinator, worker, genmodel, out = sys.argv[1:5]
    quick = "--quick" in sys.argv[5:]
    trials = int(sys.argv[sys.argv.index("--recovery") + 1]) if "--recovery" in sys.argv else 0
    tmp = tempfile.mkdtemp(prefix="lorastep_transactions_")
    cases, recovery = [], []
    layouts = [] if "--recovery_only" in sys.argv else LAYOUTS[:1] if quick else LAYOUTS
    try:
        for layout, preset, buckets in layouts:
            model = os.path.join(tmp, preset)
            if not os.path.exists(model):
                subprocess.run([genmodel, "--preset", preset, "--seed", "3", "--out", model], check=True,
                               stdout=subprocess.DEVNULL)
            for bucket in buckets:
                for failure in FAILURES:
                    case = run_case(coordinator, worker, model, layout, bucket, failure, tmp)
                    cases.append(case)
                    print(json.dumps(case), flush=True)
        if trials:
            model = os.path.join(tmp, "tiny")
            if not os.path.exists(model):
                subprocess.run([genmodel, "--preset", "tiny", "--seed", "3", "--out", model], check=True,
                               stdout=subprocess.DEVNULL)
            busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
            try:
                for trial in range(trials):
                    recovery.append(recovery_trial(coordinator, worker, model, tmp, trial))
                    print(json.dumps(recovery[-1]), flush=True)
            finally:
                for b in busy:
                    b.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    refused = [c for c in cases if c.get("code") == "FAILED_PRECONDITION" and not c["ranks_that_applied"]]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}, CPU (gloo)",
        "code_version": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
        "library_versions": {p: debian_version(p) for p in ("libtorch-dev", "libgrpc++-dev")},
        "command": "bash bench/transactions.sh " + " ".join(sys.argv[5:]),
        "cases": cases,
        "summary": {"cases": len(cases), "refused_with_nothing_applied": len(refused)},
        "recovery": recovery_summary(recovery) if trials else None,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(refused)} of {len(cases)} cases refused before the optimizer with nothing applied")
    recovered = all(t.get("recovered") for t in recovery)
    return 0 if len(refused) == len(cases) and recovered else 1


if __name__ == "__main__":
    sys.exit(main())
