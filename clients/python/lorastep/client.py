"""TrainingClient / Run: the lorastep Trainer API for Python orchestrators.

Datums follow Tinker's contract (lorastep.types.Datum, or a dict with its keys): tokens,
target_tokens, and optionally weights, logprobs (sampler), advantages, ref_logprobs,
old_logprobs, each a list per position. Mutating calls get a fresh request_id and the run's
next sequence_id; transient failures (UNAVAILABLE, DEADLINE_EXCEEDED) are retried with the
same request_id, which the server applies once.

Every call has an *_async twin returning a concurrent.futures.Future. A run's calls run in
the order they were submitted (one queue per run), so an orchestrator can queue
forward_backward_async + optim_step_async and sample the next batch meanwhile, as Tinker's
SDK allows; calls on different runs overlap.
"""
import concurrent.futures
import os
import threading
import time
import uuid

import grpc

from lorastep.types import (AdamWParams, BatchTotals, Checkpoint, ExportResult, ForwardResult, LossConfig,
                            SamplingParams, StepRecord, StepResult, batch_fields, message_proto, metrics_dict,
                            replica_hashes, run_info, sample_result)
from lorastep.v1 import trainer_pb2, trainer_pb2_grpc

# The channel's message limit; Forward(Backward) requests state it, so a call whose
# log-probs would not fit is refused before any work instead of after.
MAX_MESSAGE_BYTES = 1 << 30

_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class LorastepError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TrainingClient:
    def __init__(self, address, timeout=30.0, api_key=None, root_certificates=None):
        """api_key: for coordinators started with --api_keys_file (sent as "authorization:
        Bearer <key>"; default: $LORASTEP_API_KEY). root_certificates: PEM bytes of the CA
        for a coordinator serving TLS (--tls_cert_file); None = plaintext."""
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        api_key = api_key if api_key is not None else os.environ.get("LORASTEP_API_KEY")
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="lorastep")

    def close(self):
        self._pool.shutdown(wait=True)
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, retries=5):
        for attempt in range(retries):
            try:
                return getattr(self._stub, method)(request, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() in _TRANSIENT and attempt + 1 < retries:
                    time.sleep(0.1 * 2 ** attempt)
                    continue
                raise LorastepError(e.code(), e.details()) from None

    def create_run(self, rank=32, alpha=32.0, dropout=0.0, target_modules=None, seed=0, run_id="",
                   expert_lora="", init_from="", init_with_optimizer=False,
                   train_attn=None, train_mlp=None, train_unembed=None):
        # expert_lora (MoE models): "per_expert" (default) or "shared_outer".
        # init_from: a PEFT adapter folder or a SaveState checkpoint (path or lorastep://
        # reference) to start from; init_with_optimizer: also its optimizer state and steps.
        # train_attn / train_mlp / train_unembed: Tinker's switches instead of target_modules
        # (when any is given the others default to True; train_unembed = LoRA on lm_head).
        switches = {k: v for k, v in (("train_attn", train_attn), ("train_mlp", train_mlp),
                                      ("train_unembed", train_unembed)) if v is not None}
        lora = trainer_pb2.LoraConfig(rank=rank, alpha=alpha, dropout=dropout,
                                      target_modules=target_modules or [], expert_lora=expert_lora,
                                      **switches)
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
        """RunInfo for every run: id, rank, alpha, learner_version, last step, status."""
        return [run_info(r) for r in self._call("ListRuns", trainer_pb2.ListRunsRequest()).runs]

    def get_run(self, run_id):
        return run_info(self._call("GetRun", trainer_pb2.GetRunRequest(run_id=run_id)))

    def create_run_async(self, **kwargs):
        return self._pool.submit(self.create_run, **kwargs)


class Run:
    """One run (adapter + optimizer state). Calls on a run are sequential; the *_async ones
    are queued in submission order on the run's own thread."""

    def __init__(self, client, run_id, next_sequence_id):
        self._client = client
        self.run_id = run_id
        self._next = next_sequence_id
        self._queue = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"run-{run_id}")
        self._lock = threading.Lock()
        # Batches travel as packed_datums where that form can say the same (False: always
        # as repeated Datum messages).
        self.pack_datums = True

    def _mutate(self, method, request):
        with self._lock:
            request.request_id = uuid.uuid4().hex
            request.sequence_id = self._next
            response = self._client._call(method, request)  # retries keep the request_id
            self._next += 1
            return response

    def _submit(self, fn, *args, **kwargs):
        return self._queue.submit(fn, *args, **kwargs)

    def forward_backward(self, datums, loss=None, batch_totals=None, activation_recompute=""):
        """Accumulates gradients; optim_step applies them. batch_totals (BatchTotals or
        {"loss_tokens": N, "samples": S}): the whole batch's, when these datums are one part
        of it. activation_recompute: "auto", "none", "selective" or "full" ("": the worker's setting).
        Returns ForwardResult(logprobs, metrics)."""
        req = trainer_pb2.ForwardBackwardRequest(
            run_id=self.run_id, **batch_fields(datums, self.pack_datums),
            loss=message_proto(trainer_pb2.LossConfig, LossConfig, loss), max_response_bytes=MAX_MESSAGE_BYTES,
            activation_recompute=activation_recompute)
        if batch_totals is not None:
            req.batch_totals.CopyFrom(message_proto(trainer_pb2.BatchTotals, BatchTotals, batch_totals))
        r = self._mutate("ForwardBackward", req)
        return ForwardResult([list(x.values) for x in r.logprobs], metrics_dict(r.metrics))

    def forward(self, datums):
        """Log-probs of each datum's targets under the current adapter (no gradient)."""
        r = self._client._call("Forward", trainer_pb2.ForwardRequest(
            run_id=self.run_id, **batch_fields(datums, self.pack_datums), max_response_bytes=MAX_MESSAGE_BYTES))
        return ForwardResult([list(x.values) for x in r.logprobs], metrics_dict(r.metrics))

    def sample(self, prompts, num_samples=1, params=None, base_model=False):
        """Completions of each prompt (a list of token ids) from the run's current adapter (or
        the base model), after the run's earlier calls. params: SamplingParams or a dict.
        Returns SampleResult (sequences[prompt][sample], with the trainer's and the sampling
        distribution's log-prob of every token, and the learner_version sampled)."""
        r = self._client._call("Sample", trainer_pb2.SampleRequest(
            run_id=self.run_id, base_model=base_model, num_samples=num_samples,
            prompts=[trainer_pb2.TokenSequence(tokens=list(p)) for p in prompts],
            params=message_proto(trainer_pb2.SamplingParams, SamplingParams, params)))
        return sample_result(r)

    def optim_step(self, adamw=None, client_metrics=None):
        """client_metrics: {name: value} of the orchestrator's own (reward, ...), kept in the
        step history as "client:<name>". Returns StepResult."""
        r = self._mutate("OptimStep", trainer_pb2.OptimStepRequest(
            run_id=self.run_id, adamw=message_proto(trainer_pb2.AdamWParams, AdamWParams, adamw),
            client_metrics=client_metrics or {}))
        return self._step(r)

    def train_step(self, datums, loss=None, adamw=None, max_tokens_per_microbatch=0, client_metrics=None,
                   activation_recompute=""):
        """forward_backward + optim_step on one batch, atomically (activation_recompute as in
        forward_backward). Returns StepResult."""
        r = self._mutate("TrainStep", trainer_pb2.TrainStepRequest(
            run_id=self.run_id, **batch_fields(datums, self.pack_datums),
            loss=message_proto(trainer_pb2.LossConfig, LossConfig, loss),
            adamw=message_proto(trainer_pb2.AdamWParams, AdamWParams, adamw),
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            client_metrics=client_metrics or {}, activation_recompute=activation_recompute))
        return self._step(r)

    def forward_backward_async(self, *args, **kwargs):
        return self._submit(self.forward_backward, *args, **kwargs)

    def forward_async(self, *args, **kwargs):
        return self._submit(self.forward, *args, **kwargs)

    def sample_async(self, *args, **kwargs):
        return self._submit(self.sample, *args, **kwargs)

    def optim_step_async(self, *args, **kwargs):
        return self._submit(self.optim_step, *args, **kwargs)

    def train_step_async(self, *args, **kwargs):
        return self._submit(self.train_step, *args, **kwargs)

    def save_async(self, path):
        return self._submit(self.save, path)

    def export_async(self, path):
        return self._submit(self.export, path)

    def close(self):
        """Waits for the run's queued calls."""
        self._queue.shutdown(wait=True)
    def save(self, path):
        return self._client._call("SaveState", trainer_pb2.SaveStateRequest(
            run_id=self.run_id, path=path)).learner_version

    def load(self, path):
        return self._mutate("LoadState", trainer_pb2.LoadStateRequest(
            run_id=self.run_id, path=path)).learner_version

    def export(self, path):
        r = self._client._call("ExportAdapter", trainer_pb2.ExportAdapterRequest(
            run_id=self.run_id, path=path))
        return ExportResult(r.path, r.adapter_sha256, r.learner_version)

    def upload_adapter(self, folder, name, piece_bytes=4 << 20, replace=False):
        """Sends a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) on this
        machine to the server's state store as lorastep://<run>/<name>, checked first like
        init_from; start a run from it with create_run(init_from=...). Returns the reference.
        An existing name is ALREADY_EXISTS unless `replace`, which replaces a PEFT adapter folder
        there (never a SaveState checkpoint)."""
        def chunks():
            first = True
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                with open(os.path.join(folder, file), "rb") as f:
                    while True:
                        data = f.read(piece_bytes)
                        if not data:
                            break
                        head = ({"run_id": self.run_id, "path": f"lorastep://{self.run_id}/{name}", "replace": replace}
                                if first else {})
                        first = False
                        yield trainer_pb2.UploadAdapterChunk(file=file, data=data, **head)
        try:
            return self._client._stub.UploadAdapter(chunks(), metadata=self._client._metadata).path
        except grpc.RpcError as e:
            raise LorastepError(e.code(), e.details()) from None

    def checkpoints(self):
        """The run's folders in the server's state store (servers started with --state_dir):
        dicts of name, ref (lorastep://<run>/<name>), bytes, modified_unix_s."""
        r = self._client._call("ListCheckpoints", trainer_pb2.ListCheckpointsRequest(run_id=self.run_id))
        return [Checkpoint(c.name, c.ref, c.bytes, c.modified_unix_s) for c in r.checkpoints]

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
            run_id=self.run_id, since_step=since_step), metadata=self._client._metadata)
        try:
            for s in stream:
                yield self._record(s)
        except grpc.RpcError as e:
            raise LorastepError(e.code(), e.details()) from None
        finally:
            stream.cancel()

    @staticmethod
    def _step(r):
        return StepResult(r.step, r.learner_version, r.adapter_sha256, metrics_dict(r.metrics), r.replicas_equal,
                          replica_hashes(r.replica_hashes))

    @staticmethod
    def _record(s):
        return StepRecord(s.step, s.kind, s.learner_version, s.unix_time_ms, s.adapter_sha256,
                          metrics_dict(s.metrics), s.replicas_equal, replica_hashes(s.replica_hashes))
