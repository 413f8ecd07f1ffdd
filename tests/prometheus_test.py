"""Observability of a real coordinator and its local worker: per-call log lines (logfmt on
stderr with run_id, request_id, method, code, duration), and the Prometheus endpoints, scraped over HTTP and
parsed with prometheus_client's exposition-format parser (Debian's python3-prometheus-client):
the values equal what the step responses said; requests are counted by method and status
code; two runs' TrainSteps sent at once share one step (occupancy gauges), and a batch whose
gradient would overflow, sent beside another run's step, is refused alone; a deleted run's
series go away; the sampler's figures (tokens, prefill once per prompt, cache blocks back to
free, also after a call abandoned by its deadline); other paths and methods are refused; a non-loopback host without
--metrics_allow_remote is refused at start-up.
  prometheus_test.py COORDINATOR WORKER GENMODEL TMPDIR   (PYTHONPATH holds the client)"""
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import grpc
from lorastep import LorastepError, TrainingClient
from lorastep.v1 import trainer_pb2, trainer_pb2_grpc
from wait_for import wait_for


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok -", what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_file(path, proc, seconds=120):
    written = wait_for(lambda: (os.path.exists(path) and open(path).read().strip()) or proc.poll() is not None,
                       seconds=seconds)
    if proc.poll() is not None and not (os.path.exists(path) and open(path).read().strip()):
        raise AssertionError(f"process exited with {proc.returncode} before writing {path}")
    if not written:
        raise AssertionError(f"{path} not written")
    return int(open(path).read())


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        check(r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), "exposition content type")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def scrape_until(port, ready, seconds=10):
    """A scrape once `ready(samples)` holds, or the last one after `seconds`: a step's figures
    are recorded after its answer is written, so a scrape right after the answer may miss them."""
    samples = [None]

    def scraped():
        samples[0] = scrape(port)
        return ready(samples[0])
    wait_for(scraped, seconds=seconds, poll=0.05)
    return samples[0]


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def datum(i, n=12, vocab=96):
    return {"tokens": [(i * 7 + j * 3) % vocab for j in range(n)],
            "target_tokens": [(i * 5 + j * 11) % vocab for j in range(n)],
            "logprobs": [-4.0] * n,
            "advantages": [0.0, 0.0] + [1.0 if i % 2 else -0.5] * (n - 2)}


def main():
    coordinator, worker, genmodel, tmp = sys.argv[1:5]
    model = os.path.join(tmp, "model")
    subprocess.run([genmodel, "--preset", "tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)

    refused = subprocess.run([coordinator, "--model", model, "--worker_binary", worker, "--port", "0",
                              "--metrics_port", "0", "--metrics_host", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    check(refused.returncode != 0 and "metrics_host: '0.0.0.0' is not a loopback address" in refused.stderr,
          "a non-loopback metrics host without --metrics_allow_remote is refused: " + refused.stderr.strip()[-120:])

    worker_port = free_port()
    files = {k: os.path.join(tmp, k) for k in ("port", "metrics_port")}
    log_path = os.path.join(tmp, "coordinator.log")
    log_file = open(log_path, "w")
    proc = subprocess.Popen([coordinator, "--model", model, "--worker_binary", worker, "--port", "0",
                             "--port_file", files["port"], "--metrics_port", "0",
                             "--metrics_port_file", files["metrics_port"],
                             "--worker_metrics_port_base", str(worker_port),
                             # two runs' calls surely meet in the window (a lone run never waits)
                             "--coschedule_window_us", "10000000"], stderr=log_file)
    try:
        port = wait_file(files["port"], proc)
        metrics_port = wait_file(files["metrics_port"], proc)
        client = TrainingClient(f"127.0.0.1:{port}")
        run = client.create_run(rank=4, alpha=8, seed=1)
        batch = [datum(i) for i in range(4)]
        steps = [run.train_step(batch, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2}) for _ in range(3)]
        try:
            run.train_step([{"tokens": [1, 2], "target_tokens": [2]}], loss={"loss_fn": "ppo"})
            check(False, "a bad batch is refused")
        except LorastepError as e:
            check(e.code.name == "INVALID_ARGUMENT", "a bad batch is INVALID_ARGUMENT")

        # Issue 26, defect 8: an idle connection does not hold a scrape (it delayed one by 2 s).
        idle = [socket.create_connection(("127.0.0.1", metrics_port)) for _ in range(3)]
        t0 = time.time()
        scrape(metrics_port)
        waited = time.time() - t0
        for sock in idle:
            sock.close()
        check(waited < 1.0, f"a scrape beside three idle connections is answered in {waited:.3f} s")
        c = scrape(metrics_port)
        rid = run.run_id
        last = steps[-1]
        check(value(c, "lorastep_steps_total", run=rid, kind="train_step") == 3, "coordinator: 3 train steps counted")
        check(value(c, "lorastep_learner_version", run=rid) == last["learner_version"] == 3, "learner_version")
        check(value(c, "lorastep_loss", run=rid) == last["metrics"]["loss:sum"], "loss equals the last response's")
        check(value(c, "lorastep_grad_norm", run=rid) == last["metrics"]["grad_norm:sum"], "grad_norm equals the response's")
        check(value(c, "lorastep_tokens_per_second", run=rid) == last["metrics"]["tokens_per_s:sum"], "tokens/s")
        step_sum = sum(s["metrics"]["time_step_s:sum"] for s in steps)
        check(value(c, "lorastep_step_phase_seconds_count", run=rid, phase="step") == 3 and
              abs(value(c, "lorastep_step_phase_seconds_sum", run=rid, phase="step") - step_sum) < 1e-9,
              "step-time histogram: 3 observations summing to the responses' time_step_s")
        check(value(c, "lorastep_step_phase_seconds_bucket", run=rid, phase="forward", le="+Inf") == 3,
              "forward phase histogram")
        check(value(c, "lorastep_requests_total", method="Trainer/TrainStep", code="OK") == 3, "TrainStep OK x3")
        check(value(c, "lorastep_requests_total", method="Trainer/TrainStep", code="INVALID_ARGUMENT") == 1,
              "TrainStep INVALID_ARGUMENT x1")
        check(value(c, "lorastep_request_duration_seconds_count", method="Trainer/CreateRun") == 1, "call durations")
        check(value(c, "lorastep_runs") == 1 and value(c, "lorastep_queue_depth") == 0, "runs 1, queue empty")

        w = scrape(worker_port)
        check(value(w, "lorastep_steps_total", run=rid, kind="train_step") == 3, "worker: 3 train steps counted")
        check(value(w, "lorastep_loss", run=rid) == last["metrics"]["loss:sum"], "worker loss equals the response's")
        check(value(w, "lorastep_requests_total", method="Worker/TrainStep", code="OK") == 3, "worker TrainStep OK x3")

        for path, method, want in (("/other", "GET", 404), ("/metrics", "POST", 405)):
            req = urllib.request.Request(f"http://127.0.0.1:{metrics_port}{path}", method=method,
                                         data=b"x" if method == "POST" else None)
            try:
                urllib.request.urlopen(req, timeout=10)
                code = 200
            except urllib.error.HTTPError as e:
                code = e.code
            check(code == want, f"{method} {path} -> {want}")

        # glog's prefix (severity, date, time, thread, file:line), then the logfmt message.
        glog = re.compile(r"^([IWEF])\d{8} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] (.*)$")
        matched = [glog.match(l) for l in open(log_path).read().splitlines()]
        call_lines = [m for m in matched if m and m.group(2).startswith("ts=")]
        check(len(call_lines) > 0, "per-call lines carry glog's prefix")
        severity = {m.group(2): m.group(1) for m in call_lines}
        lines = [m.group(2) for m in call_lines]

        def logged(**fields):
            return [l for l in lines if all(f" {k}={v}" in " " + l for k, v in fields.items())]
        ok_lines = logged(component="coordinator", method="Trainer/TrainStep", code="OK", run_id=rid)
        check(len(ok_lines) == 3 and all("request_id=" in l and "duration_ms=" in l and l.startswith("ts=")
                                         for l in ok_lines), "coordinator logs each TrainStep with ids and duration")
        bad = logged(component="coordinator", method="Trainer/TrainStep", code="INVALID_ARGUMENT", run_id=rid)
        check(len(bad) == 1 and 'msg="datums[0].target_tokens: length 1' in bad[0] and "level=warn" in bad[0]
              and severity[bad[0]] == "W",
              "a refused call is logged with its message")
        check(len(logged(component="worker", method="Worker/TrainStep", code="OK", run_id=rid)) == 3,
              "the worker logs its calls too")
        check(not logged(method="Health/Check"), "health checks are not logged at --v 1")
        # Co-scheduling: two runs' TrainSteps sent at once share one step; the occupancy gauges
        # and the window's wait show what the responses say, on the coordinator and the worker.
        other = client.create_run(rank=2, alpha=4, seed=2)
        answers, errors = {}, []

        def send(r):
            try:
                answers[r.run_id] = r.train_step(batch, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2})
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=send, args=(r,)) for r in (run, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(not errors, f"both co-scheduled calls answered: {errors}")
        tokens = sum(len(d["tokens"]) for d in batch)
        def shared_step_recorded(samples):
            return all(value(samples, "lorastep_step_phase_seconds_count", run=r.run_id, phase="coschedule_wait")
                       for r in (run, other))
        c, w = scrape_until(metrics_port, shared_step_recorded), scrape_until(worker_port, shared_step_recorded)
        for r in (run, other):
            m = answers[r.run_id]["metrics"]
            check(m.get("co_scheduled_runs:max") == 2 and m.get("co_scheduled_tokens:max") == 2 * tokens,
                  f"{r.run_id}: the step shared by 2 runs, {2 * tokens} tokens: {m}")
            for side, samples in (("coordinator", c), ("worker", w)):
                check(value(samples, "lorastep_co_scheduled_runs", run=r.run_id) == 2 and
                      value(samples, "lorastep_co_scheduled_tokens", run=r.run_id) == 2 * tokens,
                      f"{side}: occupancy gauges of {r.run_id}")
                # Only the shared step passed the co-scheduling queue: the run's earlier steps,
                # with no other run on the worker, skipped it.
                check(value(samples, "lorastep_step_phase_seconds_count", run=r.run_id, phase="coschedule_wait") == 1,
                      f"{side}: the window's wait observed for {r.run_id}'s shared step only")
        # Isolation: a batch whose gradient would overflow (advantages of 3e38 under the sum
        # normalization) sent beside another run's step is refused alone, before any work; the
        # other run steps.
        huge = [dict(d, advantages=[a and 3e38 for a in d["advantages"]]) for d in batch]
        versions = {r.run_id: answers[r.run_id]["learner_version"] for r in (run, other)}
        answers.clear()
        refused = []

        def send_huge():
            try:
                other.train_step(huge, loss={"loss_fn": "ppo", "normalization": "sum"}, adamw={"lr": 1e-2})
            except LorastepError as e:
                refused.append(e)
        threads = [threading.Thread(target=send, args=(run,)), threading.Thread(target=send_huge)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        check(not errors and answers[rid]["learner_version"] == versions[rid] + 1,
              "beside a refused run, the other run steps")
        check(len(refused) == 1 and refused[0].code.name == "INVALID_ARGUMENT" and "advantages" in str(refused[0]),
              f"the overflowing batch is refused by name: {refused}")
        check(client.get_run(other.run_id).learner_version == versions[other.run_id],
              "and changes nothing of its run")
        # Sampling: tokens and prefill counted, blocks back to free once answered; a call
        # abandoned by its deadline frees its sequences' blocks at once.
        sampled = run.sample([[1, 2, 3, 4, 5], [6, 7, 8]], num_samples=4, params={"max_tokens": 6, "seed": 1})
        w = scrape_until(worker_port, lambda w: value(w, "lorastep_sampled_tokens_total") == 48)
        check(value(w, "lorastep_sampled_tokens_total") == 48 and value(w, "lorastep_prefill_tokens_total") == 8,
              "sampled and prefill tokens counted (each prompt prefilled once for its 4 samples)")
        check(value(w, "lorastep_kv_blocks") > 0 and value(w, "lorastep_kv_blocks_used") == 0 and
              value(w, "lorastep_sampler_running_sequences") == 0, "the cache is free once the call is answered")
        check(value(w, "lorastep_sample_time_to_first_token_seconds_count") == 2, "time to first token per prompt")
        check(len(sampled.sequences) == 2, "two prompts answered")
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        long = trainer_pb2.SampleRequest(run_id=rid, num_samples=16, prompts=[
            trainer_pb2.TokenSequence(tokens=[i % 90 + 1] * 8) for i in range(32)],
            params=trainer_pb2.SamplingParams(max_tokens=500, temperature=1.0))
        try:
            stub.Sample(long, timeout=2)
            raise AssertionError("a 256k-token sample answered within 2 s")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, f"the long sample passed its deadline: {e.code()}")
        w = scrape_until(worker_port, lambda w: value(w, "lorastep_kv_blocks_used") == 0 and
                         value(w, "lorastep_sampler_running_sequences") == 0, seconds=30)
        check(value(w, "lorastep_kv_blocks_used") == 0 and value(w, "lorastep_sampler_running_sequences") == 0,
              "the abandoned sample's blocks are free")
        client.delete_run(other.run_id)
        client.delete_run(rid)
        c = scrape(metrics_port)
        check(value(c, "lorastep_runs") == 0 and not any(("run", rid) in k[1] for k in c),
              "a deleted run's series are gone")
        w = scrape(worker_port)
        check(not any(("run", rid) in k[1] for k in w), "and on the worker")
    finally:
        proc.terminate()
        proc.wait(30)
    print("prometheus: all passed")


if __name__ == "__main__":
    main()
