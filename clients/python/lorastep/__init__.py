"""Python client for the lorastep LoRA training service.

    from lorastep import TrainingClient, Datum, LossConfig, AdamWParams
    client = TrainingClient("127.0.0.1:50051")
    run = client.create_run(rank=16, alpha=32)
    out = run.train_step(datums, loss=LossConfig(loss_fn="ppo"), adamw=AdamWParams(lr=1e-4))
    out.metrics["loss:sum"]                      # typed results (also out["metrics"])
    fut = run.forward_backward_async(datums)     # futures; a run's calls keep their order
"""
# The generated lorastep.v1 modules may live in another sys.path root (a build folder).
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from lorastep.client import LorastepError, Run, TrainingClient  # noqa: E402
from lorastep.types import (AdamWParams, BatchTotals, Checkpoint, Datum, ExportResult,  # noqa: E402
                            ForwardResult, LossConfig, ReplicaHash, RunInfo, SampledSequence, SampleResult,
                            SamplingParams, StepRecord, StepResult)

__all__ = ["AdamWParams", "BatchTotals", "Checkpoint", "Datum", "ExportResult", "ForwardResult", "LorastepError",
           "LossConfig", "ReplicaHash", "Run", "RunInfo", "SampledSequence", "SampleResult", "SamplingParams",
           "StepRecord", "StepResult", "TrainingClient"]
