"""The Tinker-compatible front's cost, on a real coordinator and worker (generated model, CPU):

  overhead: one training step of 64 datums x 512 tokens (forward_backward with cross_entropy,
    then optim_step) driven through the front as the SDK drives it (protobuf body, futures
    retrieved) and through the gRPC API (the same request, raw stubs), alternating, on two runs
    of the same seed; overhead_fraction = (front median - gRPC median) / gRPC median.
  idle_polls: 1,000 retrieve_future long-polls held open on futures that stay pending (each
    a forward_backward waiting for a seq_id that never comes): the coordinator's RSS and
    thread count before and while they are held.

Prints `name=value` lines (bench/tinker_front.sh collects them).
  PYTHONPATH=bazel-bin/clients/python:<dir of tinker_public_pb2.py> /usr/bin/python3 bench/tinker_front.py \
      COORDINATOR WORKER GENMODEL TMPDIR [--steps N] [--polls N] [--preset P]"""
import http.client
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid

import grpc
import numpy as np
import tinker_public_pb2 as pb
from lorastep.v1 import trainer_pb2 as v1, trainer_pb2_grpc

KEY = "tml-bench-0123456789abcdef"


def arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def proc_status(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Front:
    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def post(self, route, body, ctype="application/json"):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        self.conn.request("POST", "/api/v1/" + route, body=body,
                          headers={"X-API-Key": KEY, "Content-Type": ctype,
                                   "X-Idempotency-Key": f"stainless-python-retry-{uuid.uuid4()}"})
        r = self.conn.getresponse()
        data = r.read()
        assert r.status == 200, (route, r.status, data[:300])
        return data if r.getheader("Content-Type") == "application/x-protobuf" else json.loads(data)

    def result(self, request_id):
        while True:
            out = self.post("retrieve_future", {"request_id": request_id, "allow_metadata_only": True})
            if isinstance(out, bytes) or out.get("type") != "try_again":
                assert not (isinstance(out, dict) and "error" in out), out
                return out


def batch(vocab, n, length, step):
    rng = np.random.default_rng(step)
    toks = rng.integers(0, vocab, (n, length + 1))
    return toks[:, :-1], toks[:, 1:]


def main():
    coordinator, worker, genmodel, tmp = sys.argv[1:5]
    steps, polls, preset = arg("--steps", 8), arg("--polls", 1000), arg("--preset", "tiny")
    n, length = 64, 512
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2)
    model = os.path.join(tmp, "model")
    subprocess.run([genmodel, "--preset", preset, "--out", model], check=True, stdout=subprocess.DEVNULL)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    with open(os.path.join(tmp, "keys"), "w") as f:
        f.write(f"{KEY} bench\n")
    files = {k: os.path.join(tmp, k) for k in ("port", "tinker_port")}
    for f in files.values():
        if os.path.exists(f):
            os.remove(f)
    proc = subprocess.Popen([coordinator, "--model", model, "--worker_binary", worker, "--port", "0", "--port_file",
                             files["port"], "--tinker_port", "0", "--tinker_port_file", files["tinker_port"],
                             "--api_keys_file", os.path.join(tmp, "keys"), "--nojournal",
                             "--tinker_model_name", "bench/base", "--tinker_gap_wait_ms", "3600000"],
                            stderr=open(os.path.join(tmp, "coordinator.log"), "w"))
    try:
        for _ in range(600):
            if all(os.path.exists(f) and open(f).read().strip() for f in files.values()):
                break
            time.sleep(0.1)
        grpc_port, tinker_port = (int(open(files[k]).read()) for k in ("port", "tinker_port"))
        front = Front(tinker_port)
        session = front.post("create_session", {"tags": [], "type": "create_session"})["session_id"]
        beating = threading.Event()

        def heartbeat():  # as the SDK does, every 10 s (a session without one expires)
            beat = Front(tinker_port)
            while not beating.wait(10):
                beat.post("session_heartbeat", {"session_id": session, "type": "session_heartbeat"})
        threading.Thread(target=heartbeat, daemon=True).start()
        model_id = front.result(front.post("create_model", {"session_id": session, "model_seq_id": 0,
                                                            "lora_config": {"rank": 8, "seed": 1}})["request_id"])[
            "model_id"]
        stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]))
        meta = (("authorization", "Bearer " + KEY),)
        run = stub.CreateRun(v1.CreateRunRequest(request_id=uuid.uuid4().hex, seed=1, lora=v1.LoraConfig(
            rank=8, alpha=32, train_attn=True, train_mlp=True, train_unembed=True)), metadata=meta).run_id
        adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}
        tinker_s, grpc_s, posts_s, tseq, gseq = [], [], [], 0, 1
        for step in range(steps + 1):  # the first of each is a warm-up
            toks, targets = batch(vocab, n, length, step)
            req = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
            for t, y in zip(toks, targets):
                d = req.data.add()
                d.model_input.add().encoded_text.tokens = t.astype(np.int32).tobytes()
                d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=y.astype(np.int64).tobytes(),
                                                                     dtype=pb.DTYPE_INT64, shape=[length]))
                d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(length, np.float32).tobytes(),
                                                               dtype=pb.DTYPE_FLOAT32, shape=[length]))
            def through_front():
                nonlocal tseq
                req.seq_id = tseq + 1
                p0 = time.perf_counter()
                fb = front.post("forward_backward", req.SerializeToString(), "application/x-protobuf")["request_id"]
                opt = front.post("optim_step", {"model_id": model_id, "seq_id": tseq + 2,
                                                "adam_params": adam})["request_id"]
                posts_s.append(time.perf_counter() - p0)
                front.result(fb)
                front.result(opt)
                tseq += 2

            def through_grpc():
                nonlocal gseq
                datums = [v1.Datum(tokens=t.tolist(), target_tokens=y.tolist(), weights=[1.0] * length)
                          for t, y in zip(toks, targets)]
                stub.ForwardBackward(v1.ForwardBackwardRequest(
                    run_id=run, request_id=uuid.uuid4().hex, sequence_id=gseq, datums=datums,
                    loss=v1.LossConfig(loss_fn="cross_entropy", normalization="sum")), metadata=meta)
                stub.OptimStep(v1.OptimStepRequest(run_id=run, request_id=uuid.uuid4().hex, sequence_id=gseq + 1,
                                                   adamw=v1.AdamWParams(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)),
                               metadata=meta)
                gseq += 2

            # Each path converts its own request (protobuf bytes; gRPC datums) inside its timing;
            # the order alternates so neither always runs on a warmer machine.
            timed = {}
            for name, fn in (("front", through_front), ("grpc", through_grpc))[::1 if step % 2 else -1]:
                t0 = time.perf_counter()
                fn()
                timed[name] = time.perf_counter() - t0
            if step:
                tinker_s.append(timed["front"])
                grpc_s.append(timed["grpc"])
        tm, gm = statistics.median(tinker_s), statistics.median(grpc_s)
        ratios = [f / g for f, g in zip(tinker_s, grpc_s)]
        print(f"step_front_s={tm:.4f}")
        print(f"step_grpc_s={gm:.4f}")
        print(f"step_front_all_s={json.dumps([round(x, 4) for x in tinker_s])}")
        print(f"step_grpc_all_s={json.dumps([round(x, 4) for x in grpc_s])}")
        print(f"overhead_fraction={(tm - gm) / gm:.4f}")
        # The front's own work before the core runs (serializing, posting, parsing, converting
        # and queueing both calls): a lower bound on what it adds, free of the step's noise.
        print(f"front_submit_s={statistics.median(posts_s[1:] or posts_s):.4f}")
        print(f"overhead_fraction_per_step={json.dumps([round(r - 1, 4) for r in ratios])}")

        # Idle long-polls: futures that stay pending (seq_id tseq + 1 never comes).
        pending = []
        small = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
        d = small.data.add()
        d.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
        d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.array([2, 3], np.int64).tobytes(),
                                                             dtype=pb.DTYPE_INT64, shape=[2]))
        for i in range(16):
            small.seq_id = tseq + 2 + i
            pending.append(front.post("forward_backward", small.SerializeToString(),
                                      "application/x-protobuf")["request_id"])
        time.sleep(1)
        rss0, threads0 = proc_status(proc.pid, "VmRSS") / 1024, proc_status(proc.pid, "Threads")
        socks = []
        for i in range(polls):
            body = json.dumps({"request_id": pending[i % len(pending)], "allow_metadata_only": True}).encode()
            s = socket.create_connection(("127.0.0.1", tinker_port))
            s.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                      b"\r\n\r\n" + body)
            socks.append(s)
        time.sleep(3)
        answered = len(select.select(socks, [], [], 0)[0])
        rss1, threads1 = proc_status(proc.pid, "VmRSS") / 1024, proc_status(proc.pid, "Threads")
        peak = proc_status(proc.pid, "VmHWM") / 1024
        for s in socks:
            s.close()
        print(f"idle_polls={polls}")
        print(f"idle_polls_answered_early={answered}")
        print(f"rss_before_polls_mb={rss0:.1f}")
        print(f"rss_with_polls_mb={rss1:.1f}")
        print(f"peak_rss_mb={peak:.1f}")
        print(f"threads_before_polls={threads0}")
        print(f"threads_with_polls={threads1}")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
