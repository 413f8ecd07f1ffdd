"""The Tinker-compatible front spoken to as the Tinker SDK 0.25.0 speaks: its routes, headers,
body forms (JSON; protobuf forward_backward, optionally zstd), call order and futures, against a
real coordinator and worker on loopback (tiny model, CPU), with two API keys.

  python3 tests/tinker_conformance_test.py COORDINATOR WORKER GENMODEL PB2_DIR [TMPDIR]

PB2_DIR holds tinker_public_pb2.py (protoc --python_out of proto/tinker/tinker_public.proto).
Prints one line per case and `conformance_cases=N`, `conformance_passed=M`; exits 1 unless all pass."""
import concurrent.futures
import http.client
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from case_runner import run_cases  # noqa: E402
from wait_for import wait_for  # noqa: E402
import uuid

import numpy as np

COORDINATOR, WORKER, GENMODEL, PB2_DIR = sys.argv[1:5]
sys.path.insert(0, PB2_DIR)
import tinker_public_pb2 as pb  # noqa: E402

KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdef000",
        "carol": "tml-carol-0123456789abcdef"}
VOCAB = 96  # the tiny preset's vocabulary


class Front:
    def __init__(self, port, key):
        self.port, self.key = port, key

    def request(self, method, route, body=None, content_type="application/json", accept="application/json",
                extra=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Accept": accept, "User-Agent": "AsyncTinker/Python 0.25.0"}
        if self.key is not None:
            headers["X-API-Key"] = self.key
        if method != "GET":
            headers["X-Idempotency-Key"] = f"stainless-python-retry-{uuid.uuid4()}"
        if body is not None:
            if not isinstance(body, bytes):
                body = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        headers.update(extra or {})
        conn.request(method, "/api/v1/" + route, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        out = (r.status, r.getheader("Content-Type"), data, r.getheader("Content-Length"))
        conn.close()
        return out

    def post(self, route, body, **kw):
        status, ctype, data, _ = self.request("POST", route, body, **kw)
        return status, (json.loads(data) if ctype and "json" in ctype else data)

    def get(self, route):
        status, _, data, _ = self.request("GET", route)
        return status, json.loads(data)

    def submit(self, route, body, **kw):
        status, answer = self.post(route, body, **kw)
        assert status == 200, (route, status, answer)
        assert isinstance(answer["request_id"], str), answer
        return answer["request_id"]

    def retrieve(self, request_id, request_type):
        """The SDK's future loop: re-poll on try_again; protobuf for ForwardBackward."""
        accept = "application/x-protobuf" if request_type in ("ForwardBackward", "Forward", "Sample") else \
            "application/json"
        for iteration in range(200):
            status, ctype, data, _ = self.request("POST", "retrieve_future",
                                                  {"request_id": request_id, "allow_metadata_only": True},
                                                  accept=accept,
                                                  extra={"X-Tinker-Request-Iteration": str(iteration),
                                                         "X-Tinker-Request-Type": request_type})
            assert status == 200, (status, data)
            if ctype == "application/x-protobuf":
                return ("proto", data)
            answer = json.loads(data)
            if answer.get("type") == "try_again":
                continue
            if "error" in answer:
                return ("failed", answer)
            return ("json", answer)
        raise AssertionError("future never finished")

    def result(self, request_id, request_type):
        kind, value = self.retrieve(request_id, request_type)
        assert kind != "failed", value
        return value


def tensor(values, dtype):
    arr = np.asarray(values, dtype={pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64,
                                    pb.DTYPE_INT32: np.int32}[dtype])
    return pb.Tensor(dense=arr.tobytes(), dtype=dtype, shape=list(arr.shape))


def datum(tokens, targets, **floats):
    d = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(
        tokens=np.asarray(tokens, np.int32).tobytes()))])
    d.loss_fn_inputs["target_tokens"].CopyFrom(tensor(targets, pb.DTYPE_INT64))
    for k, v in floats.items():
        d.loss_fn_inputs[k].CopyFrom(tensor(v, pb.DTYPE_FLOAT32))
    return d


def sft_batch(step, n=4, length=12):
    rng = np.random.default_rng(step)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB, length + 1)
        w = np.ones(length, np.float32)
        w[: length // 3] = 0  # a prompt part
        out.append(datum(toks[:-1], toks[1:], weights=w))
    return out


def fwdbwd_body(model_id, seq_id, data, loss_fn="cross_entropy", config=None, forward_only=False):
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=data, loss_fn=loss_fn,
                                    forward_only=forward_only)
    for k, v in (config or {}).items():
        req.loss_fn_config[k] = v
    return req.SerializeToString()


def decode_output(raw):
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(raw)
    rec = out.loss_fn_outputs[0]
    lp = rec.fields["logprobs"]
    offsets = np.frombuffer(lp.offsets, np.int64)
    data = np.frombuffer(lp.data, np.float32)
    per = [data[offsets[i] // 4: offsets[i + 1] // 4] for i in range(len(offsets) - 1)]
    assert rec.num_datums == len(per)
    return per, dict(out.metrics)


class Model:
    """A TrainingClient's state: its id and seq_id counter."""

    def __init__(self, front, session, model_seq_id=0, rank=4, seed=7):
        self.front = front
        rid = front.submit("create_model", {"session_id": session, "model_seq_id": model_seq_id,
                                            "base_model": front.base_model, "user_metadata": {},
                                            "lora_config": {"rank": rank, "seed": seed, "train_unembed": False,
                                                            "train_mlp": True, "train_attn": True},
                                            "type": "create_model"})
        self.model_id = front.result(rid, "CreateModel")["model_id"]
        self.seq = 0

    def next_seq(self):
        self.seq += 1
        return self.seq

    def forward_backward(self, data, loss_fn="cross_entropy", config=None, forward_only=False):
        rid = self.front.submit("forward_backward", fwdbwd_body(self.model_id, self.next_seq(), data, loss_fn, config,
                                                                forward_only),
                                content_type="application/x-protobuf")
        return decode_output(self.front.result(rid, "ForwardBackward"))

    def optim_step(self, lr=1e-2):
        rid = self.front.submit("optim_step", {"adam_params": {"learning_rate": lr, "beta1": 0.9, "beta2": 0.95,
                                                               "eps": 1e-12, "weight_decay": 0.0,
                                                               "grad_clip_norm": 0.0},
                                               "model_id": self.model_id, "seq_id": self.next_seq(),
                                               "type": "optim_step"})
        return self.front.result(rid, "OptimStep")


def session(front):
    status, answer = front.post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.25.0",
                                                   "type": "create_session"})
    assert status == 200 and isinstance(answer["session_id"], str), answer
    return answer["session_id"]


CASES = []


def case(fn):
    CASES.append(fn)
    return fn


@case
def client_config(ctx):
    status, answer = ctx.alice.post("client/config", {"sdk_version": "0.25.0"})
    assert status == 200 and answer["use_pyqwest_transport"] is False and answer["pjwt_auth_enabled"] is False
    status, answer = ctx.alice.post("client/dynamic_config", {"sdk_version": "0.25.0"})
    assert status == 200 and answer["refresh_interval_sec"] > 0


@case
def telemetry_and_health(ctx):
    status, answer = ctx.alice.post("telemetry", {"events": [], "platform": "linux", "sdk_version": "0.25.0",
                                                  "session_id": "sessionless-x", "process_uuid": "u"})
    assert (status, answer) == (200, {"status": "accepted"}), answer
    assert ctx.alice.get("healthz") == (200, {"status": "ok"})


@case
def server_capabilities(ctx):
    status, answer = ctx.alice.get("get_server_capabilities")
    assert status == 200
    [model] = answer["supported_models"]
    assert model["model_name"] == ctx.alice.base_model and model["max_context_length"] > 0, answer


@case
def session_and_heartbeat(ctx):
    s = session(ctx.alice)
    assert ctx.alice.post("session_heartbeat", {"session_id": s, "type": "session_heartbeat"}) == (200, {})
    status, answer = ctx.alice.post("session_heartbeat", {"session_id": "tnope", "type": "session_heartbeat"})
    assert status == 404 and "session_id" in answer["detail"], answer
    status, answer = ctx.bob.post("session_heartbeat", {"session_id": s, "type": "session_heartbeat"})
    assert status == 404, "another key's session is not found"
    # A transport retry of create_session (same X-Idempotency-Key, same body) gets the same
    # session; the key with another body is refused; another API key's same header is its own.
    body = {"tags": ["retry"], "user_metadata": {}, "sdk_version": "0.25.0", "type": "create_session"}
    retry = {"X-Idempotency-Key": "stainless-python-retry-conformance-1"}
    first = ctx.alice.post("create_session", body, extra=retry)
    assert first[0] == 200 and ctx.alice.post("create_session", body, extra=retry) == first, first
    status, answer = ctx.alice.post("create_session", dict(body, tags=["other"]), extra=retry)
    assert status == 400 and "X-Idempotency-Key" in answer["detail"], (status, answer)
    other = ctx.bob.post("create_session", body, extra=retry)
    assert other[0] == 200 and other[1]["session_id"] != first[1]["session_id"], other
    # The REST client's sessions: the key's own live ones, paged; one session's models and
    # samplers; another key's session not found.
    status, listed = ctx.alice.get("sessions?limit=1000")
    assert status == 200 and s in listed["sessions"] and other[1]["session_id"] not in listed["sessions"], listed
    status, page = ctx.alice.get("sessions?limit=1&offset=1")
    assert status == 200 and page["sessions"] == listed["sessions"][1:2], (page, listed)
    m = Model(ctx.alice, s)
    assert ctx.alice.get(f"sessions/{s}") == (200, {"training_run_ids": [m.model_id], "sampler_ids": []})
    assert ctx.bob.get(f"sessions/{s}")[0] == 404


@case
def create_model_and_info(ctx):
    s = session(ctx.alice)
    m = Model(ctx.alice, s, 0)
    assert m.model_id == f"{s}:train:0", m.model_id
    status, info = ctx.alice.post("get_info", {"model_id": m.model_id, "type": "get_info"})
    assert status == 200 and info["model_data"]["model_name"] == ctx.alice.base_model, info
    # The SDK re-sends create_model with the same (session, model_seq_id): the same future.
    body = {"session_id": s, "model_seq_id": 0, "lora_config": {"rank": 4}, "type": "create_model"}
    again = ctx.alice.submit("create_model", body)
    assert ctx.alice.result(again, "CreateModel")["model_id"] == m.model_id


@case
def supervised_loop(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    losses = []
    for step in range(4):
        data = sft_batch(0)
        logprobs, metrics = m.forward_backward(data)
        assert len(logprobs) == len(data) and all(len(lp) == 12 for lp in logprobs)
        assert all(k.count(":") == 1 for k in metrics), metrics
        # loss:sum is the weighted negative log-likelihood summed over tokens.
        w = [np.frombuffer(d.loss_fn_inputs["weights"].dense, np.float32) for d in data]
        expected = -sum(float(np.dot(a.astype(np.float64), b)) for a, b in zip(logprobs, w))
        assert math.isclose(metrics["loss:sum"], expected, rel_tol=1e-5), (metrics["loss:sum"], expected)
        losses.append(metrics["loss:sum"])
        answer = m.optim_step()
        assert isinstance(answer["metrics"], dict)
    assert losses[-1] < losses[0], losses


@case
def chunks_out_of_order(ctx):
    """forward_backward in two chunks, the second posted first (the SDK's parallel chunks): the
    step equals one request with every datum."""
    s = session(ctx.alice)
    whole, chunked = Model(ctx.alice, s, 0, seed=11), Model(ctx.alice, s, 1, seed=11)
    data = sft_batch(3, n=6)
    whole.forward_backward(data)
    whole.optim_step()
    first, second = chunked.next_seq(), chunked.next_seq()
    r2 = ctx.alice.submit("forward_backward", fwdbwd_body(chunked.model_id, second, data[3:]),
                          content_type="application/x-protobuf")
    r1 = ctx.alice.submit("forward_backward", fwdbwd_body(chunked.model_id, first, data[:3]),
                          content_type="application/x-protobuf")
    lp1, _ = decode_output(ctx.alice.result(r1, "ForwardBackward"))
    lp2, _ = decode_output(ctx.alice.result(r2, "ForwardBackward"))
    assert len(lp1) == 3 and len(lp2) == 3
    chunked.optim_step()
    after_whole, _ = whole.forward_backward(data, forward_only=True)
    after_chunked, _ = chunked.forward_backward(data, forward_only=True)
    for a, b in zip(after_whole, after_chunked):
        assert np.allclose(a, b, atol=1e-6), np.abs(a - b).max()


@case
def concurrent_chunks(ctx):
    """Eight chunks posted at once from threads, the first last."""
    m = Model(ctx.alice, session(ctx.alice))
    data = sft_batch(5, n=8)
    seqs = [m.next_seq() for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        later = list(pool.map(lambda i: ctx.alice.submit("forward_backward", fwdbwd_body(m.model_id, seqs[i],
                                                                                      [data[i]]),
                                                         content_type="application/x-protobuf"), range(1, 8)))
    first = ctx.alice.submit("forward_backward", fwdbwd_body(m.model_id, seqs[0], [data[0]]),
                             content_type="application/x-protobuf")
    for rid in [first] + later:
        lp, metrics = decode_output(ctx.alice.result(rid, "ForwardBackward"))
        assert len(lp) == 1 and "loss:sum" in metrics
    m.optim_step()


@case
def replayed_request(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    body = fwdbwd_body(m.model_id, m.next_seq(), sft_batch(1))
    r1 = ctx.alice.submit("forward_backward", body, content_type="application/x-protobuf")
    r2 = ctx.alice.submit("forward_backward", body, content_type="application/x-protobuf")
    assert r1 == r2, "a retried request gets the first one's future"
    ctx.alice.result(r1, "ForwardBackward")
    other = fwdbwd_body(m.model_id, m.seq, sft_batch(2))
    status, answer = ctx.alice.post("forward_backward", other, content_type="application/x-protobuf")
    assert status == 400 and "seq_id" in answer["detail"], (status, answer)


@case
def zstd_body(ctx):
    import zstandard
    m = Model(ctx.alice, session(ctx.alice))
    body = zstandard.ZstdCompressor().compress(fwdbwd_body(m.model_id, m.next_seq(), sft_batch(1)))
    rid = ctx.alice.submit("forward_backward", body, content_type="application/x-protobuf",
                           extra={"Content-Encoding": "zstd"})
    lp, metrics = decode_output(ctx.alice.result(rid, "ForwardBackward"))
    assert len(lp) == 4 and "loss:sum" in metrics


def rl_inputs(m, step):
    """Datums with the sampler's log-probs taken from a forward pass and random advantages."""
    base = sft_batch(10 + step)
    logprobs, _ = m.forward_backward(base, forward_only=True)
    rng = np.random.default_rng(step)
    out = []
    for d, lp in zip(base, logprobs):
        toks = np.frombuffer(d.model_input[0].encoded_text.tokens, np.int32)
        targets = np.frombuffer(d.loss_fn_inputs["target_tokens"].dense, np.int64)
        q = lp - rng.uniform(0, 0.1, lp.shape).astype(np.float32)
        out.append(datum(toks, targets, logprobs=q, advantages=rng.normal(size=lp.shape).astype(np.float32)))
    return out


def rl_loss(loss_fn, lp, q, a, config):
    lp, q, a = (np.asarray(x, np.float64) for x in (lp, q, a))
    r = np.exp(lp - q)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return -(r * a).sum()
    if loss_fn == "ppo":
        return -np.minimum(r * a, np.clip(r, lo, hi) * a).sum()
    if loss_fn == "cispo":
        return -(np.clip(r, lo, hi) * lp * a).sum()
    beta = config.get("beta", 0.05)
    return -(lp * a - beta / 2 * (lp - q) ** 2).sum()


for _loss, _config in [("importance_sampling", {}), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                       ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}), ("dro", {"beta": 0.1})]:
    def _rl_case(ctx, loss_fn=_loss, config=_config):
        m = Model(ctx.alice, session(ctx.alice))
        for step in range(2):
            data = rl_inputs(m, step)
            logprobs, metrics = m.forward_backward(data, loss_fn, config)
            expected = sum(rl_loss(loss_fn, lp, np.frombuffer(d.loss_fn_inputs["logprobs"].dense, np.float32),
                                   np.frombuffer(d.loss_fn_inputs["advantages"].dense, np.float32), config)
                           for d, lp in zip(data, logprobs))
            assert math.isclose(metrics["loss:sum"], expected, rel_tol=1e-4, abs_tol=1e-4), \
                (metrics["loss:sum"], expected)
            m.optim_step(lr=1e-3)
    _rl_case.__name__ = f"rl_loop_{_loss}"
    case(_rl_case)


def refused(front, body, want_status, want_text, content_type="application/x-protobuf", route="forward_backward"):
    status, answer = front.post(route, body, content_type=content_type)
    assert status == want_status, (status, answer)
    assert want_text in answer["detail"], answer
    return answer


def sparse(arr, dtype):
    """A 2-D array as the SDK's sparse CSR tensor."""
    arr = np.asarray(arr)
    rows, cols, vals = [0], [], []
    for row in arr:
        nz = np.nonzero(row)[0]
        cols += nz.tolist()
        vals += row[nz].tolist()
        rows.append(len(cols))
    np_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}[dtype]
    return pb.Tensor(sparse_csr=pb.SparseCsr(values=np.asarray(vals, np_dtype).tobytes(),
                                             crow_indices=np.asarray(rows, np.int64).tobytes(),
                                             col_indices=np.asarray(cols, np.int64).tobytes()),
                     dtype=dtype, shape=list(arr.shape))


@case
def top_k_cross_entropy(ctx):
    """cross_entropy with [N, K] targets and weights (dense, and the weights sparse): the result
    holds [N, K] log-probs, each column the log-prob a one-target pass gives, and loss:sum is
    -sum(w * lp) over every target."""
    s = session(ctx.alice)
    dense_m, sparse_m, single = (Model(ctx.alice, s, i, seed=31) for i in range(3))
    rng = np.random.default_rng(4)
    tokens = [rng.integers(0, VOCAB, 10) for _ in range(2)]
    targets = [rng.integers(0, VOCAB, (10, 3)) for _ in range(2)]
    weights = [np.where(rng.random((10, 3)) < 0.5, rng.random((10, 3)), 0).astype(np.float32) for _ in range(2)]

    def topk_datum(t, y, w, sparse_weights=False):
        d = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=t.astype(np.int32).tobytes()))])
        d.loss_fn_inputs["target_tokens"].CopyFrom(tensor(y, pb.DTYPE_INT64))
        d.loss_fn_inputs["weights"].CopyFrom(sparse(w, pb.DTYPE_FLOAT32) if sparse_weights else
                                             tensor(w, pb.DTYPE_FLOAT32))
        return d
    lp_dense, metrics = dense_m.forward_backward([topk_datum(*x) for x in zip(tokens, targets, weights)])
    lp_sparse, metrics_sparse = sparse_m.forward_backward(
        [topk_datum(*x, sparse_weights=True) for x in zip(tokens, targets, weights)])
    per_datum = [lp.reshape(10, 3) for lp in lp_dense]
    expected = -sum(float((w.astype(np.float64) * lp).sum()) for w, lp in zip(weights, per_datum))
    assert math.isclose(metrics["loss:sum"], expected, rel_tol=1e-5), (metrics["loss:sum"], expected)
    assert metrics_sparse["loss:sum"] == metrics["loss:sum"], "sparse weights are the same weights"
    assert all(np.array_equal(a, b) for a, b in zip(lp_dense, lp_sparse))
    for k in range(3):
        one, _ = single.forward_backward([datum(t, y[:, k], weights=np.ones(10)) for t, y in zip(tokens, targets)],
                                         forward_only=True)
        for a, b in zip(per_datum, one):
            assert np.allclose(a[:, k], b, atol=1e-6), (a[:, k], b)
    mixed = [topk_datum(tokens[0], targets[0], weights[0]), topk_datum(tokens[1], targets[1][:, :2], weights[1][:, :2])]
    refused(ctx.alice, fwdbwd_body(dense_m.model_id, 2, mixed), 400, "data[1].loss_fn_inputs.target_tokens")
    rl = datum(tokens[0], targets[0][:, 0], logprobs=np.zeros(10), advantages=np.ones(10))
    rl.loss_fn_inputs["target_tokens"].CopyFrom(tensor(targets[0], pb.DTYPE_INT64))
    refused(ctx.alice, fwdbwd_body(dense_m.model_id, 2, [rl], loss_fn="ppo"), 400, "cross_entropy only")


@case
def bad_unknown_loss(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    refused(ctx.alice, fwdbwd_body(m.model_id, 1, sft_batch(1), loss_fn="gspo"), 400, "loss_fn")


@case
def bad_dtype(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    data = sft_batch(1)
    data[1].loss_fn_inputs["weights"].CopyFrom(tensor([1] * 12, pb.DTYPE_INT64))
    refused(ctx.alice, fwdbwd_body(m.model_id, 1, data), 400, "data[1].loss_fn_inputs.weights")


@case
def bad_shape(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    data = sft_batch(1)
    data[2].loss_fn_inputs["target_tokens"].CopyFrom(tensor([1] * 11, pb.DTYPE_INT64))
    refused(ctx.alice, fwdbwd_body(m.model_id, 1, data), 400, "data[2].loss_fn_inputs.target_tokens")
    data = sft_batch(1)
    data[0].loss_fn_inputs["target_tokens"].CopyFrom(tensor(np.ones((12, 3)), pb.DTYPE_INT64))
    refused(ctx.alice, fwdbwd_body(m.model_id, 1, data), 400, "data[0].loss_fn_inputs.weights: 0 values per token")


@case
def bad_token_out_of_vocabulary(ctx):
    """Found by the coordinator after submission: the future fails with category user, and the
    model goes on (the next seq_id runs)."""
    m = Model(ctx.alice, session(ctx.alice))
    data = sft_batch(1)
    data[0] = datum([1, 2, VOCAB + 5], [2, 3, 4], weights=[1, 1, 1])
    rid = ctx.alice.submit("forward_backward", fwdbwd_body(m.model_id, m.next_seq(), data),
                           content_type="application/x-protobuf")
    kind, answer = ctx.alice.retrieve(rid, "ForwardBackward")
    assert kind == "failed" and answer["category"] == "user" and "outside [0, 96)" in answer["error"], answer
    m.forward_backward(sft_batch(1))
    m.optim_step()


@case
def bad_unknown_model(ctx):
    refused(ctx.alice, fwdbwd_body("tnope:train:0", 1, sft_batch(1)), 404, "model_id")
    status, answer = ctx.alice.post("get_info", {"model_id": "not-a-model", "type": "get_info"})
    assert status == 404, answer


@case
def another_keys_model(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    refused(ctx.bob, fwdbwd_body(m.model_id, 1, sft_batch(1)), 404, "model_id")
    status, _ = ctx.bob.post("optim_step", {"model_id": m.model_id, "seq_id": 1, "adam_params": {},
                                            "type": "optim_step"})
    assert status == 404
    rid = ctx.alice.submit("forward_backward", fwdbwd_body(m.model_id, m.next_seq(), sft_batch(1)),
                           content_type="application/x-protobuf")
    status, _, data, _ = ctx.bob.request("POST", "retrieve_future", {"request_id": rid})
    assert status == 404, "another key's future is not found"
    ctx.alice.result(rid, "ForwardBackward")
    status, _ = ctx.bob.get(f"training_runs/{m.model_id}/checkpoints")
    assert status == 404, "another key's model's checkpoints are not found"
    status, _ = ctx.alice.get(f"training_runs/{m.model_id}/checkpoints")
    assert status == 200


@case
def bad_key(ctx):
    nokey = Front(ctx.alice.port, None)
    status, ctype, data, length = nokey.request("POST", "create_session", {"tags": []})
    assert status == 401 and int(length) > 0 and "X-API-Key" in json.loads(data)["detail"]
    wrong = Front(ctx.alice.port, "tml-wrong-0123456789abcdef")
    assert wrong.request("POST", "create_session", {"tags": []})[0] == 401


@case
def unknown_route(ctx):
    status, _, data, length = ctx.alice.request("POST", "publish_everything", {})
    assert status == 404 and int(length) > 0 and json.loads(data)["detail"]


@case
def bad_adam_params(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    status, answer = ctx.alice.post("optim_step", {"model_id": m.model_id, "seq_id": 1,
                                                   "adam_params": {"learning_rate": "fast"}, "type": "optim_step"})
    assert status == 400 and "adam_params.learning_rate" in answer["detail"], answer


@case
def oversized_body_refused_before_read(ctx):
    """Headers declaring 9 MiB (the limit is 8): answered before any body byte is sent."""
    conn = http.client.HTTPConnection("127.0.0.1", ctx.alice.port, timeout=60)
    conn.putrequest("POST", "/api/v1/forward_backward")
    for k, v in {"X-API-Key": ctx.alice.key, "Content-Type": "application/x-protobuf",
                 "Content-Length": str(9 << 20)}.items():
        conn.putheader(k, v)
    conn.endheaders()
    r = conn.getresponse()
    detail = json.loads(r.read())["detail"]
    assert r.status == 400 and "tinker_max_request_mb" in detail, (r.status, detail)
    conn.close()


@case
def seq_gap(ctx):
    """A seq_id that never comes: the model goes on after the gap wait; when it comes late it
    is refused (category user, by the submission's 400)."""
    m = Model(ctx.alice, session(ctx.alice))
    skipped, used = m.next_seq(), m.next_seq()
    rid = ctx.alice.submit("forward_backward", fwdbwd_body(m.model_id, used, sft_batch(1)),
                           content_type="application/x-protobuf")
    ctx.alice.result(rid, "ForwardBackward")
    refused(ctx.alice, fwdbwd_body(m.model_id, skipped, sft_batch(1)), 400, "seq_id")


def save(m, route, **fields):
    body = {"model_id": m.model_id, "seq_id": m.next_seq(), "type": route}
    body.update(fields)
    rid = m.front.submit(route, body)
    return m.front.result(rid, "SaveWeights" if route == "save_weights" else "SaveWeightsForSampler")


def load(m, path, optimizer):
    rid = m.front.submit("load_weights", {"model_id": m.model_id, "seq_id": m.next_seq(), "path": path,
                                          "optimizer": optimizer, "type": "load_weights"})
    return m.front.result(rid, "LoadWeights")


def sample(front, sampler_id, seq_id, tokens, num_samples=2, max_tokens=6, **extra):
    body = {"num_samples": num_samples, "prompt": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 5, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
            "sampling_session_id": sampler_id, "seq_id": seq_id, "prompt_logprobs": False,
            "topk_prompt_logprobs": 0, "type": "sample"}
    body.update(extra)
    rid = front.submit("asample", body, extra={"X-Tinker-Sampling-Backpressure": "1"})
    kind, raw = front.retrieve(rid, "Sample")
    assert kind == "proto", raw
    out = pb.SampleResponse()
    out.ParseFromString(raw)
    return out


@case
def save_and_resume_bitwise(ctx):
    """save_weights, then (as a new process would) weights_info, create_model with that rank,
    load_weights with the optimizer at seq_id 1: the next step equals the uninterrupted run's."""
    m = Model(ctx.alice, session(ctx.alice), rank=4, seed=3)
    for step in range(2):
        m.forward_backward(sft_batch(step))
        m.optim_step()
    path = save(m, "save_weights", path="step-2")["path"]
    assert path == f"tinker://{m.model_id}/weights/step-2", path
    s2 = session(ctx.alice)
    status, info = ctx.alice.post("weights_info", {"tinker_path": path})
    assert status == 200 and info["lora_rank"] == 4 and info["is_lora"] is True, info
    # The model's switches (train_unembed false here): the SDK makes the new model with them.
    assert (info.get("train_attn"), info.get("train_mlp"), info.get("train_unembed")) == (True, True, False), info
    resumed = Model(ctx.alice, s2, 0, rank=info["lora_rank"], seed=99)
    assert load(resumed, path, optimizer=True) == {}
    for model in (m, resumed):
        model.forward_backward(sft_batch(7))
        model.optim_step()
    a, _ = m.forward_backward(sft_batch(8), forward_only=True)
    b, _ = resumed.forward_backward(sft_batch(8), forward_only=True)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), "the resumed run's step is bitwise the same"
    # Without the optimizer: the same weights, fresh moments, so the next step differs.
    fresh = Model(ctx.alice, s2, 1, rank=4, seed=5)
    load(fresh, path, optimizer=False)
    c, _ = fresh.forward_backward(sft_batch(8), forward_only=True)
    m2, _ = Model(ctx.alice, s2, 2, rank=4, seed=3), None
    load(m2, path, optimizer=True)
    d, _ = m2.forward_backward(sft_batch(8), forward_only=True)
    assert all(np.array_equal(x, y) for x, y in zip(c, d)), "weights load either way"
    for model in (fresh, m2):
        model.forward_backward(sft_batch(7))
        model.optim_step()
    c, _ = fresh.forward_backward(sft_batch(8), forward_only=True)
    d, _ = m2.forward_backward(sft_batch(8), forward_only=True)
    assert not all(np.array_equal(x, y) for x, y in zip(c, d)), "optimizer=false starts the moments afresh"


@case
def save_name_clash(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    save(m, "save_weights", path="dup")
    rid = ctx.alice.submit("save_weights", {"model_id": m.model_id, "seq_id": m.next_seq(), "path": "dup",
                                            "type": "save_weights"})
    kind, answer = ctx.alice.retrieve(rid, "SaveWeights")
    assert kind == "failed" and answer["category"] == "user" and "dup" in answer["error"], answer
    status, answer = ctx.alice.post("save_weights", {"model_id": m.model_id, "seq_id": m.next_seq(),
                                                     "path": "../x", "type": "save_weights"})
    assert status == 400 and "path" in answer["detail"], answer


@case
def sampler_from_training(ctx):
    """The RL loop's unnamed save_weights_for_sampler, then asample on it: tokens and log-probs
    of the trained weights; a named one through create_sampling_session; compute_logprobs."""
    s = session(ctx.alice)
    m = Model(ctx.alice, s)
    m.forward_backward(sft_batch(0))
    m.optim_step()
    answer = save(m, "save_weights_for_sampler", sampling_session_seq_id=0)
    sampler = answer["sampling_session_id"]
    assert sampler == f"{s}:sample:0", answer
    out = sample(ctx.alice, sampler, 0, [1, 2, 3], num_samples=3, max_tokens=5)
    assert len(out.sequences) == 3
    for seq in out.sequences:
        toks = np.frombuffer(seq.tokens, np.int32)
        lps = np.frombuffer(seq.logprobs, np.float32)
        assert 1 <= len(toks) <= 5 and len(lps) == len(toks) and np.all(lps <= 0), (toks, lps)
        assert seq.stop_reason in (pb.STOP_REASON_STOP, pb.STOP_REASON_LENGTH)
    # The sampled tokens' log-probs are the trainer's: a forward pass over prompt + completion.
    seq = out.sequences[0]
    toks = [1, 2, 3] + [int(t) for t in np.frombuffer(seq.tokens, np.int32)]
    lp, _ = m.forward_backward([datum(toks[:-1], toks[1:], weights=[0.0] * (len(toks) - 1))], forward_only=True)
    want = lp[0][-len(np.frombuffer(seq.tokens, np.int32)):]
    assert np.allclose(want, np.frombuffer(seq.logprobs, np.float32), atol=1e-5), (want, seq.logprobs)
    # compute_logprobs: one token, prompt_logprobs, NaN first.
    out = sample(ctx.alice, sampler, 1, toks, num_samples=1, max_tokens=1, prompt_logprobs=True)
    plp = np.frombuffer(out.prompt_logprobs, np.float32)
    assert len(plp) == len(toks) and math.isnan(plp[0]), plp
    assert np.allclose(plp[1:], lp[0], atol=1e-5), (plp[1:], lp[0])
    # topk_prompt_logprobs: an N x k matrix, the first row padding, each row in falling order,
    # and a prompt token among its row's k has the prompt log-prob found above.
    out = sample(ctx.alice, sampler, 3, toks, num_samples=1, max_tokens=1, prompt_logprobs=True,
                 topk_prompt_logprobs=4)
    top = out.topk_prompt_logprobs
    assert (top.k, top.prompt_length) == (4, len(toks)), (top.k, top.prompt_length)
    ids = np.frombuffer(top.token_ids, np.int32).reshape(len(toks), 4)
    vals = np.frombuffer(top.logprobs, np.float32).reshape(len(toks), 4)
    assert np.all(ids[0] == 0) and np.all(vals[0] == -99999.0), (ids[0], vals[0])
    assert np.all(np.diff(vals[1:], axis=1) <= 0) and np.all(vals[1:] <= 0), vals
    for i in range(1, len(toks)):
        assert vals[i][0] >= plp[i] - 1e-6, (i, vals[i], plp[i])
        if toks[i] in ids[i]:
            assert abs(vals[i][list(ids[i]).index(toks[i])] - plp[i]) <= 1e-5, (i, ids[i], vals[i], plp[i])
    status, answer = ctx.alice.post("asample", {
        "num_samples": 1, "prompt": {"chunks": [{"tokens": toks, "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 1}, "sampling_session_id": sampler, "seq_id": 4,
        "topk_prompt_logprobs": 65, "type": "sample"})
    assert status == 400 and "topk_prompt_logprobs" in answer["detail"], (status, answer)
    # A named sampler checkpoint, through create_sampling_session.
    path = save(m, "save_weights_for_sampler", path="for-eval")["path"]
    assert path == f"tinker://{m.model_id}/sampler_weights/for-eval"
    status, answer = ctx.alice.post("create_sampling_session", {"session_id": s, "sampling_session_seq_id": 1,
                                                                "model_path": path,
                                                                "type": "create_sampling_session"})
    assert status == 200, answer
    named = answer["sampling_session_id"]
    again = sample(ctx.alice, named, 0, [1, 2, 3], num_samples=3, max_tokens=5)
    first = sample(ctx.alice, sampler, 2, [1, 2, 3], num_samples=3, max_tokens=5)
    assert [x.tokens for x in again.sequences] == [x.tokens for x in first.sequences], "same weights, same seed"
    assert ctx.alice.get(f"samplers/{named}") == (200, {"sampler_id": named, "base_model": "tiny/base",
                                                         "model_path": path})


@case
def rl_loop_with_sampling(ctx):
    """The RL loop as tinker-cookbook runs it: each iteration saves the weights for a sampler,
    samples a group per prompt, scores the completions, and trains on them with the sampler's
    log-probs (importance_sampling, ppo, cispo, dro in turn); the sampler's log-probs equal the
    learner's on the first pass, so each loss starts at ratio 1."""
    s = session(ctx.alice)
    m = Model(ctx.alice, s, rank=4)
    prompts = [[1, 2, 3], [7, 8], [20, 21, 22, 23]]
    for it, loss_fn in enumerate(["importance_sampling", "ppo", "cispo", "dro"]):
        sampler = save(m, "save_weights_for_sampler", sampling_session_seq_id=it)["sampling_session_id"]
        data, rewards = [], []
        for p, prompt in enumerate(prompts):
            out = sample(ctx.alice, sampler, p, prompt, num_samples=4, max_tokens=6)
            group = []
            for seq in out.sequences:
                toks = [int(t) for t in np.frombuffer(seq.tokens, np.int32)]
                group.append((toks, np.frombuffer(seq.logprobs, np.float32),
                              float(np.mean(np.asarray(toks) < VOCAB // 8))))
            mean = np.mean([r for _, _, r in group])
            for toks, lps, reward in group:
                full = prompt + toks
                n = len(full) - 1
                q = np.zeros(n, np.float32)
                q[len(prompt) - 1:] = lps
                adv = np.zeros(n, np.float32)
                adv[len(prompt) - 1:] = reward - mean
                data.append(datum(full[:-1], full[1:], logprobs=q, advantages=adv))
        logprobs, metrics = m.forward_backward(data, loss_fn, {"beta": 0.05} if loss_fn == "dro" else {})
        for d, lp in zip(data, logprobs):
            q = np.frombuffer(d.loss_fn_inputs["logprobs"].dense, np.float32)
            adv = np.frombuffer(d.loss_fn_inputs["advantages"].dense, np.float32)
            sampled = adv != 0
            assert np.allclose(lp[sampled], q[sampled], atol=1e-5), "sampler log-probs are the learner's"
        assert math.isfinite(metrics["loss:sum"])
        m.optim_step(lr=1e-3)


@case
def base_model_sampler(ctx):
    s = session(ctx.alice)
    status, answer = ctx.alice.post("create_sampling_session", {"session_id": s, "sampling_session_seq_id": 0,
                                                                "base_model": "tiny/base",
                                                                "type": "create_sampling_session"})
    assert status == 200, answer
    out = sample(ctx.alice, answer["sampling_session_id"], 0, [4, 5], num_samples=2, max_tokens=4,
                 sampling_params={"max_tokens": 4, "seed": 1, "temperature": 0.0, "top_k": -1, "top_p": 1.0})
    assert out.sequences[0].tokens == out.sequences[1].tokens, "greedy"
    status, answer = ctx.alice.post("create_sampling_session", {"session_id": s, "sampling_session_seq_id": 1,
                                                                "base_model": "Qwen/Qwen3-8B",
                                                                "type": "create_sampling_session"})
    assert status == 400 and "base_model" in answer["detail"], answer
    status, answer = ctx.alice.post("asample", {"num_samples": 1, "prompt": {"chunks": [{"tokens": [1],
                                                                                         "type": "encoded_text"}]},
                                                "sampling_params": {"max_tokens": 2, "stop": ["\n\n"]},
                                                "sampling_session_id": f"{s}:sample:0", "seq_id": 9})
    assert status == 400 and "stop" in answer["detail"], answer
    status, _ = ctx.bob.post("asample", {"num_samples": 1, "prompt": {"chunks": [{"tokens": [1]}]},
                                         "sampling_params": {"max_tokens": 2},
                                         "sampling_session_id": f"{s}:sample:0", "seq_id": 10})
    assert status == 404, "another key's sampler"


@case
def rest_runs_checkpoints_archive(ctx):
    import io
    import tarfile
    m = Model(ctx.alice, session(ctx.alice), rank=4)
    m.forward_backward(sft_batch(0))
    m.optim_step()
    save(m, "save_weights", path="ck")
    save(m, "save_weights_for_sampler", path="ck")
    status, runs = ctx.alice.get("training_runs?limit=1000&offset=0&access_scope=owned")
    assert status == 200 and m.model_id in [r["training_run_id"] for r in runs["training_runs"]], runs
    assert runs["cursor"]["total_count"] >= 1
    status, run = ctx.alice.get(f"training_runs/{m.model_id}?access_scope=owned")
    assert status == 200 and run["lora_rank"] == 4 and run["is_lora"] is True and "T" in run["last_request_time"]
    assert ctx.bob.get(f"training_runs/{m.model_id}")[0] == 404
    status, listed = ctx.alice.get(f"training_runs/{m.model_id}/checkpoints")
    ids = sorted(c["checkpoint_id"] for c in listed["checkpoints"])
    assert status == 200 and ids == ["sampler_weights/ck", "weights/ck"], listed
    for kind in ("sampler_weights", "weights"):
        status, link = ctx.alice.get(f"training_runs/{m.model_id}/checkpoints/{kind}/ck/archive")
        assert status == 200 and link["url"].startswith("http://") and link["expires"], link
        url = link["url"].split("/api/v1/", 1)[1]
        status, ctype, data, _ = Front(ctx.alice.port, None).request("GET", url)
        assert status == 200 and ctype == "application/x-tar", (status, data[:200])
        files = tarfile.open(fileobj=io.BytesIO(data)).getnames()
        assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"], files
        tar = tarfile.open(fileobj=io.BytesIO(data))
        config = json.load(tar.extractfile("adapter_config.json"))
        assert config["r"] == 4 and config["peft_type"] == "LORA", config
        st = tar.extractfile("adapter_model.safetensors").read()
        header = json.loads(st[8:8 + int.from_bytes(st[:8], "little")])
        assert any(k.endswith("lora_A.weight") for k in header) and any(k.endswith("lora_B.weight") for k in header)
    assert ctx.bob.get(f"training_runs/{m.model_id}/checkpoints/weights/ck/archive")[0] == 404
    status, _, _, _ = ctx.alice.request("DELETE", f"training_runs/{m.model_id}/checkpoints/weights/ck")
    assert status == 200
    status, listed = ctx.alice.get(f"training_runs/{m.model_id}/checkpoints")
    assert [c["checkpoint_id"] for c in listed["checkpoints"]] == ["sampler_weights/ck"], listed
    status, _, _, _ = ctx.alice.request("DELETE", f"training_runs/{m.model_id}/checkpoints/weights/ck")
    assert status == 404


@case
def bitwise_equal_to_grpc(ctx):
    """The same run driven through the front and through the gRPC API ends with the same
    adapter, bit for bit (its SHA-256 after every step)."""
    import grpc
    from lorastep.v1 import trainer_pb2 as v1, trainer_pb2_grpc
    stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{ctx.grpc_port}"))
    meta = (("authorization", "Bearer " + KEYS["alice"]),)
    m = Model(ctx.alice, session(ctx.alice), rank=4, seed=21)
    run = stub.CreateRun(v1.CreateRunRequest(request_id=uuid.uuid4().hex, seed=21, lora=v1.LoraConfig(
        rank=4, alpha=32, train_attn=True, train_mlp=True, train_unembed=False)), metadata=meta).run_id
    seq = 1
    tinker_digests, grpc_digests = [], []
    for step in range(3):
        data = sft_batch(40 + step)
        m.forward_backward(data)
        m.optim_step(lr=1e-2)
        datums = [v1.Datum(tokens=np.frombuffer(d.model_input[0].encoded_text.tokens, np.int32).tolist(),
                           target_tokens=np.frombuffer(d.loss_fn_inputs["target_tokens"].dense, np.int64).tolist(),
                           weights=np.frombuffer(d.loss_fn_inputs["weights"].dense, np.float32).tolist())
                  for d in data]
        stub.ForwardBackward(v1.ForwardBackwardRequest(run_id=run, request_id=uuid.uuid4().hex, sequence_id=seq,
                                                       datums=datums, loss=v1.LossConfig(loss_fn="cross_entropy",
                                                                                         normalization="sum")),
                             metadata=meta)
        answer = stub.OptimStep(v1.OptimStepRequest(run_id=run, request_id=uuid.uuid4().hex, sequence_id=seq + 1,
                                                    adamw=v1.AdamWParams(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-12,
                                                                         weight_decay=0.0, max_grad_norm=0.0)),
                                metadata=meta)
        seq += 2
        grpc_digests.append(answer.adapter_sha256)
    steps = stub.GetStepMetrics(v1.GetStepMetricsRequest(run_id=m.model_id.replace(":train:", "-train-")),
                                metadata=meta).steps
    tinker_digests = [s.adapter_sha256 for s in steps]
    assert tinker_digests == grpc_digests and len(set(grpc_digests)) == 3, (tinker_digests, grpc_digests)
    ctx.bitwise_equal_to_grpc = True


@case
def unload_model(ctx):
    m = Model(ctx.alice, session(ctx.alice))
    rid = ctx.alice.submit("unload_model", {"model_id": m.model_id, "type": "unload_model"})
    assert ctx.alice.result(rid, "UnloadModel") == {"model_id": m.model_id}
    status, _ = ctx.alice.post("get_info", {"model_id": m.model_id, "type": "get_info"})
    assert status == 404


def metric(port, name):
    """A gauge's value on the Prometheus endpoint at `port`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def start_coordinator(ctx, *flags):
    """A second coordinator on the test's model with `flags`; returns (process, tinker port);
    its Prometheus port is then in ctx.second_metrics_port."""
    tmp = tempfile.mkdtemp(dir=ctx.tmp)
    port_file, metrics_file = os.path.join(tmp, "port"), os.path.join(tmp, "metrics_port")
    proc = subprocess.Popen([COORDINATOR, "--model", ctx.model, "--worker_binary", WORKER, "--port", "0",
                             "--nojournal", "--tinker_port", "0", "--tinker_port_file", port_file,
                             "--tinker_model_name", "tiny/base", "--state_dir", os.path.join(tmp, "state"),
                             "--metrics_port", "0", "--metrics_port_file", metrics_file] +
                            list(flags), stderr=open(os.path.join(tmp, "log"), "w"))
    written = lambda: all(os.path.exists(f) and open(f).read().strip() for f in (port_file, metrics_file))
    wait_for(lambda: written() or proc.poll() is not None)
    if not written():
        raise AssertionError("coordinator exited or wrote no port: " + open(os.path.join(tmp, "log")).read()[-2000:])
    ctx.second_metrics_port = int(open(metrics_file).read())
    return proc, int(open(port_file).read())


@case
def tls(ctx):
    """With the Trainer API's certificate the front speaks HTTPS only."""
    import ssl
    tmp = tempfile.mkdtemp(dir=ctx.tmp)
    cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    proc, port = start_coordinator(ctx, "--tls_cert_file", cert, "--tls_key_file", key)
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30,
                                           context=ssl.create_default_context(cafile=cert))
        conn.request("GET", "/api/v1/healthz")
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            plain.request("GET", "/api/v1/healthz")
            plain.getresponse()
            raise AssertionError("plain HTTP was answered")
        except (http.client.HTTPException, ConnectionError):
            pass
    finally:
        proc.terminate()
        proc.wait(60)


@case
def shutdown_with_held_polls(ctx):
    """SIGTERM while retrieves are held on pending futures: each is answered (try_again) and
    the coordinator exits cleanly (libmicrohttpd aborts the process if it is stopped with a
    suspended connection)."""
    import threading
    proc, port = start_coordinator(ctx, "--tinker_gap_wait_ms", "600000")
    front = Front(port, None)
    front.base_model = "tiny/base"
    m = Model(front, session(front))
    pending = front.submit("forward_backward", fwdbwd_body(m.model_id, 5, sft_batch(0)),
                           content_type="application/x-protobuf")  # seq_id 1-4 never come
    answers = []
    polls = [threading.Thread(target=lambda: answers.append(front.request("POST", "retrieve_future",
                                                                          {"request_id": pending})))
             for _ in range(3)]
    for t in polls:
        t.start()
    wait_for(lambda: metric(ctx.second_metrics_port, "lorastep_tinker_held_polls") >= 3, poll=0.05)
    proc.terminate()
    assert proc.wait(60) == 0, "the coordinator exits cleanly"
    for t in polls:
        t.join(60)
    assert len(answers) == 3 and all(json.loads(a[2])["type"] == "try_again" for a in answers), answers


@case
def session_expiry(ctx):
    """A session without heartbeats expires (--tinker_session_ttl_s, 1 s here): its heartbeat and
    new models are refused and its models deleted; a session that beats stays."""
    proc, port = start_coordinator(ctx, "--tinker_session_ttl_s", "1")
    try:
        front = Front(port, None)
        front.base_model = "tiny/base"
        idle, beating = session(front), session(front)
        m = Model(front, idle)
        kept = Model(front, beating)
        def idle_model_gone():
            assert front.post("session_heartbeat", {"session_id": beating})[0] == 200
            return front.post("get_info", {"model_id": m.model_id})[0] == 404
        wait_for(idle_model_gone, poll=0.3)
        status, answer = front.post("get_info", {"model_id": m.model_id})
        assert status == 404, "the idle session's model is deleted"
        status, answer = front.post("session_heartbeat", {"session_id": idle})
        assert status == 404 and "expired" in answer["detail"], answer
        status, answer = front.post("create_model", {"session_id": idle, "model_seq_id": 1, "lora_config": {"rank": 2}})
        assert status == 404, answer
        assert front.post("get_info", {"model_id": kept.model_id})[0] == 200, "a beating session keeps its models"
    finally:
        proc.terminate()
        proc.wait(60)


@case
def sessions_per_key_bounded(ctx):
    """One key holds at most 256 live sessions; the 257th is 429 (the SDK waits and retries)
    naming the bound, and another key is not affected."""
    carol = Front(ctx.alice.port, KEYS["carol"])
    for _ in range(256):
        session(carol)
    status, answer = carol.post("create_session", {"tags": [], "type": "create_session"})
    assert status == 429 and "256 live sessions" in answer["detail"], (status, answer)
    session(ctx.bob)


@case
def requests_counted_in_prometheus(ctx):
    """The front's requests are counted like gRPC calls: Tinker/<route> by the status code
    their HTTP status stands for (this case runs after the others)."""
    ctx.alice.post("get_info", {"model_id": "tnope:train:0"})
    conn = http.client.HTTPConnection("127.0.0.1", ctx.metrics_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("lorastep_requests_total{") and 'method="Tinker/' in line:
            labels, value = line.rsplit(" ", 1)
            counts[labels] = float(value)
    def count(method, code):
        return sum(v for k, v in counts.items() if f'method="Tinker/{method}"' in k and f'code="{code}"' in k)
    assert count("forward_backward", "OK") >= 10 and count("retrieve_future", "OK") >= 10, counts
    assert count("get_info", "NOT_FOUND") >= 1 and count("create_session", "UNAUTHENTICATED") >= 1, counts
    assert count("training_runs", "OK") >= 1, "ids are left out of the route"


class Ctx:
    pass


def main():
    tmp = sys.argv[5] if len(sys.argv) > 5 else tempfile.mkdtemp()
    model = os.path.join(tmp, "model")
    subprocess.run([GENMODEL, "--preset", "tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)
    keys = os.path.join(tmp, "keys")
    with open(keys, "w") as f:
        f.write("".join(f"{k} {owner}\n" for owner, k in KEYS.items()))
    port_file, grpc_port_file = os.path.join(tmp, "tinker_port"), os.path.join(tmp, "port")
    metrics_port_file = os.path.join(tmp, "metrics_port")
    for f in (port_file, grpc_port_file, metrics_port_file):
        if os.path.exists(f):
            os.remove(f)
    log = open(os.path.join(tmp, "coordinator.log"), "w")
    proc = subprocess.Popen([COORDINATOR, "--model", model, "--worker_binary", WORKER, "--port", "0", "--nojournal",
                             "--port_file", grpc_port_file, "--metrics_port", "0",
                             "--metrics_port_file", metrics_port_file,
                             "--state_dir", os.path.join(tmp, "state"),
                             "--api_keys_file", keys, "--tinker_port", "0", "--tinker_port_file", port_file,
                             "--tinker_model_name", "tiny/base", "--tinker_max_request_mb", "8",
                             "--tinker_gap_wait_ms", "500"], stderr=log)
    try:
        if not wait_for(lambda: (os.path.exists(port_file) and open(port_file).read().strip()) or
                        proc.poll() is not None) or proc.poll() is not None:
            raise SystemExit("coordinator exited at start or wrote no port: see " + log.name)
        port = int(open(port_file).read())
        ctx = Ctx()
        ctx.tmp, ctx.model = tmp, model
        ctx.grpc_port = int(open(grpc_port_file).read())
        ctx.metrics_port = int(open(metrics_port_file).read())
        ctx.bitwise_equal_to_grpc = False
        ctx.alice, ctx.bob = Front(port, KEYS["alice"]), Front(port, KEYS["bob"])
        ctx.alice.base_model = ctx.bob.base_model = "tiny/base"
        passed = run_cases(CASES, ctx)
        print(f"bitwise_equal_to_grpc={str(ctx.bitwise_equal_to_grpc).lower()}")
        print(f"conformance_cases={len(CASES)}")
        print(f"conformance_passed={passed}")
        return 0 if passed == len(CASES) else 1
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
