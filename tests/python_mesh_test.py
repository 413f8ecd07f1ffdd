"""The Python client drives a TP2 x PP2 x DP2 CPU mesh (8 worker processes on c10d gloo)
through the coordinator (started by clients_test.sh): every step response and every kept
record carries per-stage replica hashes, all equal, and training moves the policy."""
import sys

from lorastep import TrainingClient
from python_client_test import check, datum


def main():
    client = TrainingClient(sys.argv[1])
    run = client.create_run(rank=4, alpha=8, seed=5)
    batch = [datum(i, n=8 + i % 5) for i in range(6)]
    losses = []
    for step in range(3):
        out = run.train_step(batch, loss={"loss_fn": "ppo"}, adamw={"lr": 1e-2},
                             max_tokens_per_microbatch=24)
        losses.append(out["metrics"]["loss:sum"])
        hashes = out["replica_hashes"]
        stages = sorted({h["stage"] for h in hashes})
        check(out["replicas_equal"] and all(h["equal"] for h in hashes),
              f"step {step}: replicas equal")
        check(stages == [0, 1], f"step {step}: hashes for both pipeline stages")
        families = {(h["stage"], h["tensor_rank"], h["family"]) for h in hashes}
        check((0, -1, "tensor_replicated") in families and (1, 1, "trainable") in families,
              f"step {step}: tensor-replicated and per-tensor-rank families")
        check(all(len(h["ranks"]) >= 2 and len(h["sha256"]) == 64 for h in hashes),
              f"step {step}: each family compared across its replicas")
    check(losses[-1] < losses[0], f"loss falls on the mesh {losses}")
    hist = run.metrics()
    check(len(hist) == 3 and all(r["replicas_equal"] and r["replica_hashes"] for r in hist),
          "step history keeps the replica hashes")
    client.close()
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
