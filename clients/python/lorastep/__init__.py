"""Python client for the lorastep LoRA training service.

    from lorastep import TrainingClient
    client = TrainingClient("127.0.0.1:50051")
    run = client.create_run(rank=16, alpha=32)
    out = run.train_step(datums, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-4})
"""
# The generated lorastep.v1 modules may live in another sys.path root (a build folder).
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from lorastep.client import LorastepError, Run, TrainingClient  # noqa: E402

__all__ = ["LorastepError", "Run", "TrainingClient"]
