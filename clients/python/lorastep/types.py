"""Typed requests and results of the lorastep Trainer API.

Requests (Datum, LossConfig, AdamWParams, BatchTotals) may also be passed as plain dicts
with the same keys. Results are dataclasses that also read like the dicts earlier versions
returned (result["metrics"] is result.metrics), so both styles work.
"""
import sys
from array import array
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional

from lorastep.v1 import trainer_pb2


class _Mapping:
    """Dict-style read access to a dataclass's fields."""

    def __getitem__(self, key):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key) if key in self.keys() else default

    def keys(self):
        return [f.name for f in fields(self)]

    def __contains__(self, key):
        return key in self.keys()

    def to_dict(self):
        return asdict(self)


# ---- requests ----------------------------------------------------------------------

@dataclass
class Datum(_Mapping):
    """One sequence in Tinker's contract: per-position lists."""
    tokens: List[int]
    target_tokens: List[int]
    weights: List[float] = field(default_factory=list)       # loss mask / SFT weights
    logprobs: List[float] = field(default_factory=list)      # the sampler's
    advantages: List[float] = field(default_factory=list)
    ref_logprobs: List[float] = field(default_factory=list)  # reference policy (KL)
    old_logprobs: List[float] = field(default_factory=list)  # the trainer's, for PPO ratios

    def to_proto(self):
        return trainer_pb2.Datum(**{f.name: list(getattr(self, f.name)) for f in fields(self)})


@dataclass
class LossConfig(_Mapping):
    """Unset (None) fields take the API's defaults (docs/API.md)."""
    loss_fn: str = ""  # cross_entropy (default) | importance_sampling | ppo | cispo | dro
    clip_eps_low: Optional[float] = None
    clip_eps_high: Optional[float] = None
    dual_clip_c: Optional[float] = None
    cispo_ratio_low: Optional[float] = None
    cispo_ratio_high: Optional[float] = None
    tis_cap: Optional[float] = None
    kl_coef: Optional[float] = None
    kl_estimator: str = ""
    entropy_coef: Optional[float] = None
    normalization: str = ""  # token (default) | sequence | sum
    dro_beta: Optional[float] = None

    def to_proto(self):
        return trainer_pb2.LossConfig(**{k: v for k, v in asdict(self).items() if v is not None and v != ""})


@dataclass
class AdamWParams(_Mapping):
    """Unset (None) fields take the API's defaults: lr 1e-5, betas 0.9/0.999, eps 1e-8,
    weight_decay 0, max_grad_norm 0 (off), constant schedule."""
    lr: Optional[float] = None
    beta1: Optional[float] = None
    beta2: Optional[float] = None
    eps: Optional[float] = None
    weight_decay: Optional[float] = None
    max_grad_norm: Optional[float] = None
    schedule: str = ""
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: Optional[float] = None

    def to_proto(self):
        return trainer_pb2.AdamWParams(**{k: v for k, v in asdict(self).items()
                                          if v is not None and v != "" and not (k.endswith("_steps") and v == 0)})


@dataclass
class BatchTotals(_Mapping):
    """The whole batch's denominators when it is sent over several forward_backward calls."""
    loss_tokens: int
    samples: int

    def to_proto(self):
        return trainer_pb2.BatchTotals(loss_tokens=self.loss_tokens, samples=self.samples)


@dataclass
class SamplingParams(_Mapping):
    """How tokens are drawn (docs/API.md, Sample): logits / temperature, then top_k (0 off),
    top_p (None: 1), min_p (0 off); temperature 0 is greedy. Sample i of a prompt draws from
    seed + i. stop_token_ids / stop_sequences end a completion after them (included)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: Optional[float] = None
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: List[int] = field(default_factory=list)
    stop_sequences: List[List[int]] = field(default_factory=list)
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0  # with prompt_logprobs: per prompt position, the k most likely

    def to_proto(self):
        p = trainer_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop_token_ids=list(self.stop_token_ids), top_logprobs=self.top_logprobs,
            prompt_logprobs=self.prompt_logprobs, prompt_top_logprobs=self.prompt_top_logprobs,
            stop_sequences=[trainer_pb2.TokenSequence(tokens=list(s)) for s in self.stop_sequences])
        if self.top_p is not None:
            p.top_p = self.top_p
        return p


_DATUM_KEYS = {f.name for f in fields(Datum)}


def datum_proto(d):
    if isinstance(d, Datum):
        return d.to_proto()
    unknown = set(d) - _DATUM_KEYS
    if unknown:
        raise ValueError(f"datum: unknown fields {sorted(unknown)}")
    return trainer_pb2.Datum(**{k: list(v) for k, v in d.items()})


_FLOAT_KEYS = ("weights", "logprobs", "advantages", "ref_logprobs", "old_logprobs")


def packed_datums(datums):
    """The datums as one PackedDatums (one little-endian int32/float32 array per field), or
    None when that form cannot say the same: an optional field on some datums only, an array
    of another length than its tokens, ids outside int32 or non-numbers. Building it takes a
    fraction of the time repeated Datum messages take, and the servers copy it instead of
    decoding every value."""
    ints = {k: array("i") for k in ("tokens", "target_tokens")}
    floats = {k: array("f") for k in _FLOAT_KEYS}
    present, lengths = {}, []
    if ints["tokens"].itemsize != 4 or floats["weights"].itemsize != 4:
        return None
    for d in datums:
        if not isinstance(d, Datum) and set(d) - _DATUM_KEYS:
            raise ValueError(f"datum: unknown fields {sorted(set(d) - _DATUM_KEYS)}")
        tokens, targets = d.get("tokens"), d.get("target_tokens")
        if tokens is None or targets is None:
            return None
        n = len(tokens)
        if len(targets) != n:
            return None
        try:
            ints["tokens"].extend(tokens)
            ints["target_tokens"].extend(targets)
            for k in _FLOAT_KEYS:
                values = d.get(k)
                values = () if values is None else values
                if present.setdefault(k, len(values) > 0) != (len(values) > 0) or len(values) not in (0, n):
                    return None
                floats[k].extend(values)
        except (OverflowError, TypeError):
            return None
        lengths.append(n)
    # Next-token targets (each datum's targets its tokens shifted by one, as in RL batches)
    # travel as one last target per datum: a quarter less to send.
    if lengths and all(lengths):
        tokens, targets, last, offset = ints["tokens"], ints["target_tokens"], array("i"), 0
        for n in lengths:
            if targets[offset:offset + n - 1] != tokens[offset + 1:offset + n]:
                break
            last.append(targets[offset + n - 1])
            offset += n
        else:
            ints = {"tokens": tokens, "last_target_tokens": last}
    arrays = {**ints, **floats}
    if sys.byteorder != "little":
        for a in arrays.values():
            a.byteswap()
    return trainer_pb2.PackedDatums(lengths=lengths, **{k: a.tobytes() for k, a in arrays.items()})


def batch_fields(datums, pack=True):
    """A request's batch fields: {"packed_datums": ...} where that form can say the same
    (pack=True), else {"datums": [...]} (the server then names any problem)."""
    datums = list(datums)
    packed = packed_datums(datums) if pack and datums else None
    return {"packed_datums": packed} if packed is not None else {"datums": [datum_proto(d) for d in datums]}


def message_proto(cls, typed, value):
    """A request sub-message from a typed instance, a dict, or None (all defaults)."""
    if value is None:
        return cls()
    if isinstance(value, typed):
        return value.to_proto()
    return cls(**value)


# ---- results -------------------------------------------------------------------------

@dataclass
class ReplicaHash(_Mapping):
    """One replicated tensor family on one pipeline stage, compared across its ranks."""
    stage: int
    tensor_rank: int
    family: str
    sha256: str
    equal: bool
    ranks: List[int]


@dataclass
class ForwardResult(_Mapping):
    logprobs: List[List[float]]  # per datum, per target position
    metrics: Dict[str, float]


@dataclass
class SampledSequence(_Mapping):
    tokens: List[int]
    logprobs: List[float]           # under the model at temperature 1: what the trainer computes
    sampling_logprobs: List[float]  # under the distribution the token was drawn from
    stop_reason: str                # "stop" or "length"
    top_logprobs: List[List[tuple]] = field(default_factory=list)  # per token: [(token, logprob)]


@dataclass
class SampleResult(_Mapping):
    sequences: List[List[SampledSequence]]  # per prompt, its num_samples completions
    prompt_logprobs: List[List[float]]      # per prompt, when asked
    learner_version: int
    metrics: Dict[str, float]
    prompt_top_logprobs: List[List[List[tuple]]] = field(default_factory=list)  # per prompt, per position


def sample_result(r):
    seqs = [[SampledSequence(list(s.tokens), list(s.logprobs), list(s.sampling_logprobs), s.stop_reason,
                             [list(zip(t.tokens, t.logprobs)) for t in s.top_logprobs])
             for s in p.sequences] for p in r.prompts]
    return SampleResult(seqs, [list(p.prompt_logprobs) for p in r.prompts], r.learner_version, dict(r.metrics),
                        [[list(zip(t.tokens, t.logprobs)) for t in p.prompt_top_logprobs] for p in r.prompts])


@dataclass
class StepResult(_Mapping):
    step: int
    learner_version: int
    adapter_sha256: str
    metrics: Dict[str, float]
    replicas_equal: bool
    replica_hashes: List[ReplicaHash]


@dataclass
class StepRecord(_Mapping):
    step: int
    kind: str
    learner_version: int
    unix_time_ms: int
    adapter_sha256: str
    metrics: Dict[str, float]
    replicas_equal: bool
    replica_hashes: List[ReplicaHash]


@dataclass
class ExportResult(_Mapping):
    path: str
    adapter_sha256: str
    learner_version: int


@dataclass
class Checkpoint(_Mapping):
    name: str
    ref: str
    bytes: int
    modified_unix_s: int


@dataclass
class RunInfo(_Mapping):
    run_id: str
    rank: int
    alpha: float
    learner_version: int
    next_sequence_id: int
    last_step: int
    created_unix_ms: int
    last_step_unix_ms: int
    diverged: str
    base_model: str
    owner: str  # the API key's owner that created it ("" without authentication)
    target_modules: List[str]  # resolved LoRA targets (train_* switches included)
    # With a journal: the learner_version a restart would resume at (None: none durable yet).
    autosaved_learner_version: Optional[int] = None


def replica_hashes(hs):
    return [ReplicaHash(h.stage, h.tensor_rank, h.family, h.sha256, h.equal, list(h.ranks)) for h in hs]


def metrics_dict(m):
    return dict(sorted(m.items()))


def run_info(r):
    return RunInfo(r.run_id, r.lora.rank, r.lora.alpha, r.learner_version, r.next_sequence_id, r.last_step,
                   r.created_unix_ms, r.last_step_unix_ms, r.diverged, r.base_model, r.owner,
                   list(r.lora.target_modules),
                   r.autosaved_learner_version if r.HasField("autosaved_learner_version") else None)
