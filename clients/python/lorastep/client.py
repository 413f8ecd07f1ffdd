"""TrainingClient / Run: the lorastep Trainer API for Python orchestrators.

Datums are dicts in Tinker's contract: tokens, target_tokens, and optionally weights,
logprobs (sampler), advantages, ref_logprobs, old_logprobs, each a list per position.
Mutating calls get a fresh request_id and the run's next sequence_id; transient failures
(UNAVAILABLE, DEADLINE_EXCEEDED) are retried with the same request_id, which the server
applies once.
"""
import time
import uuid

import grpc

from lorastep.v1 import trainer_pb2, trainer_pb2_grpc

_DATUM_FIELDS = ("tokens", "target_tokens", "weights", "logprobs", "advantages",
                 "ref_logprobs", "old_logprobs")
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class LorastepError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _datum(d):
    unknown = set(d) - set(_DATUM_FIELDS)
    if unknown:
        raise ValueError(f"datum: unknown fields {sorted(unknown)}")
    return trainer_pb2.Datum(**{k: list(v) for k, v in d.items()})


def _message(cls, fields):
    return cls(**(fields or {}))


def _replica_hash(h):
    """One replicated tensor family on one pipeline stage, compared across its ranks."""
    return {"stage": h.stage, "tensor_rank": h.tensor_rank, "family": h.family,
            "sha256": h.sha256, "equal": h.equal, "ranks": list(h.ranks)}


def _metrics(m):
    return dict(sorted(m.items()))


class TrainingClient:
    def __init__(self, address, timeout=30.0):
        options = [("grpc.max_receive_message_length", 1 << 30),
                   ("grpc.max_send_message_length", 1 << 30)]
        self._channel = grpc.insecure_channel(address, options=options)
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def close(self):
        self._channel.close()

    def _call(self, method, request, retries=5):
        for attempt in range(retries):
            try:
                return getattr(self._stub, method)(request)
            except grpc.RpcError as e:
                if e.code() in _TRANSIENT and attempt + 1 < retries:
                    time.sleep(0.1 * 2 ** attempt)
                    continue
                raise LorastepError(e.code(), e.details()) from None

    def create_run(self, rank=32, alpha=32.0, dropout=0.0, target_modules=None, seed=0, run_id="",
                   expert_lora="", init_from="", init_with_optimizer=False):
        # expert_lora (MoE models): "per_expert" (default) or "shared_outer".
        # init_from: a PEFT adapter folder or a SaveState checkpoint (path or lorastep://
        # reference) to start from; init_with_optimizer: also its optimizer state and steps.
        lora = trainer_pb2.LoraConfig(rank=rank, alpha=alpha, dropout=dropout,
                                      target_modules=target_modules or [], expert_lora=expert_lora)
        run = self._call("CreateRun", trainer_pb2.CreateRunRequest(
            request_id=uuid.uuid4().hex, lora=lora, seed=seed, run_id=run_id,
            init_from=init_from, init_with_optimizer=init_with_optimizer))
        return Run(self, run.run_id, run.next_sequence_id)

    def delete_run(self, run_id):
        """Frees the run on every rank; NOT_FOUND (LorastepError) for an unknown run."""
        self._call("DeleteRun", trainer_pb2.DeleteRunRequest(run_id=run_id))

    def attach(self, run_id):
        run = self._call("GetRun", trainer_pb2.GetRunRequest(run_id=run_id))
        return Run(self, run.run_id, run.next_sequence_id)

    def list_runs(self):
        return list(self._call("ListRuns", trainer_pb2.ListRunsRequest()).runs)


class Run:
    """One run (adapter + optimizer state). Calls on a run are sequential."""

    def __init__(self, client, run_id, next_sequence_id):
        self._client = client
        self.run_id = run_id
        self._next = next_sequence_id

    def _mutate(self, method, request):
        request.request_id = uuid.uuid4().hex
        request.sequence_id = self._next
        response = self._client._call(method, request)  # retries keep the request_id
        self._next += 1
        return response

    def forward_backward(self, datums, loss=None, batch_totals=None):
        """batch_totals: {"loss_tokens": N, "samples": S} of the whole batch when these datums
        are one part of it (several calls before one optim_step)."""
        req = trainer_pb2.ForwardBackwardRequest(
            run_id=self.run_id, datums=[_datum(d) for d in datums],
            loss=_message(trainer_pb2.LossConfig, loss))
        if batch_totals is not None:
            req.batch_totals.CopyFrom(_message(trainer_pb2.BatchTotals, batch_totals))
        r = self._mutate("ForwardBackward", req)
        return {"logprobs": [list(x.values) for x in r.logprobs], "metrics": _metrics(r.metrics)}

    def forward(self, datums):
        r = self._client._call("Forward", trainer_pb2.ForwardRequest(
            run_id=self.run_id, datums=[_datum(d) for d in datums]))
        return {"logprobs": [list(x.values) for x in r.logprobs], "metrics": _metrics(r.metrics)}

    def optim_step(self, adamw=None, client_metrics=None):
        """client_metrics: {name: value} of the orchestrator's own (reward, ...), kept in the
        step history as "client:<name>"."""
        r = self._mutate("OptimStep", trainer_pb2.OptimStepRequest(
            run_id=self.run_id, adamw=_message(trainer_pb2.AdamWParams, adamw),
            client_metrics=client_metrics or {}))
        return self._step(r)

    def train_step(self, datums, loss=None, adamw=None, max_tokens_per_microbatch=0, client_metrics=None):
        r = self._mutate("TrainStep", trainer_pb2.TrainStepRequest(
            run_id=self.run_id, datums=[_datum(d) for d in datums],
            loss=_message(trainer_pb2.LossConfig, loss),
            adamw=_message(trainer_pb2.AdamWParams, adamw),
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            client_metrics=client_metrics or {}))
        return self._step(r)

    def save(self, path):
        return self._client._call("SaveState", trainer_pb2.SaveStateRequest(
            run_id=self.run_id, path=path)).learner_version

    def load(self, path):
        return self._mutate("LoadState", trainer_pb2.LoadStateRequest(
            run_id=self.run_id, path=path)).learner_version

    def export(self, path):
        r = self._client._call("ExportAdapter", trainer_pb2.ExportAdapterRequest(
            run_id=self.run_id, path=path))
        return {"path": r.path, "adapter_sha256": r.adapter_sha256,
                "learner_version": r.learner_version}

    def checkpoints(self):
        """The run's folders in the server's state store (servers started with --state_dir):
        dicts of name, ref (lorastep://<run>/<name>), bytes, modified_unix_s."""
        r = self._client._call("ListCheckpoints", trainer_pb2.ListCheckpointsRequest(run_id=self.run_id))
        return [{"name": c.name, "ref": c.ref, "bytes": c.bytes, "modified_unix_s": c.modified_unix_s}
                for c in r.checkpoints]

    def delete_checkpoint(self, name):
        self._client._call("DeleteCheckpoint", trainer_pb2.DeleteCheckpointRequest(
            run_id=self.run_id, name=name))

    def metrics(self, since_step=0, limit=0):
        r = self._client._call("GetStepMetrics", trainer_pb2.GetStepMetricsRequest(
            run_id=self.run_id, since_step=since_step, limit=limit))
        return [self._record(s) for s in r.steps]

    def watch(self, since_step=0):
        """Yields step records (dicts) as they are made; break to stop."""
        stream = self._client._stub.WatchMetrics(trainer_pb2.WatchMetricsRequest(
            run_id=self.run_id, since_step=since_step))
        try:
            for s in stream:
                yield self._record(s)
        finally:
            stream.cancel()

    @staticmethod
    def _step(r):
        return {"step": r.step, "learner_version": r.learner_version,
                "adapter_sha256": r.adapter_sha256, "metrics": _metrics(r.metrics),
                "replicas_equal": r.replicas_equal,
                "replica_hashes": [_replica_hash(h) for h in r.replica_hashes]}

    @staticmethod
    def _record(s):
        return {"step": s.step, "kind": s.kind, "learner_version": s.learner_version,
                "unix_time_ms": s.unix_time_ms, "adapter_sha256": s.adapter_sha256,
                "metrics": _metrics(s.metrics), "replicas_equal": s.replicas_equal,
                "replica_hashes": [_replica_hash(h) for h in s.replica_hashes]}
