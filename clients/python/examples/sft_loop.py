"""Supervised fine-tuning over a JSONL file against a running lorastep coordinator.

Each line is {"prompt": [token ids], "completion": [token ids]}; the model learns to predict
the completion (cross-entropy on completion tokens only, weights 0 on the prompt). Batches
go to the trainer as forward_backward_async + optim_step_async, so the next batch is built
while the trainer works on the current one (a run's calls keep their order). Prints the loss
per step and exits non-zero unless the last epoch's mean loss is below the first's.
    python3 examples/sft_loop.py --address 127.0.0.1:50051 --data train.jsonl --epochs 3
    python3 examples/sft_loop.py ... --make_data 64 --vocab 96   (writes a synthetic file first)
"""
import argparse
import json
import random
import statistics
import sys

from lorastep import AdamWParams, Datum, LossConfig, TrainingClient


def make_data(path, n, vocab, seed=3):
    """Synthetic task: the completion is the prompt reversed (learnable, not memorizable
    token by token)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 10))]
            f.write(json.dumps({"prompt": prompt, "completion": prompt[::-1]}) + "\n")


def read_examples(path):
    examples = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), list) or not isinstance(row.get("completion"), list):
                raise SystemExit(f"{path}:{i}: each line needs 'prompt' and 'completion' lists of token ids")
            examples.append(row)
    return examples


def to_datum(row):
    seq = row["prompt"] + row["completion"]
    weights = [0.0] * (len(row["prompt"]) - 1) + [1.0] * len(row["completion"])
    return Datum(tokens=seq[:-1], target_tokens=seq[1:], weights=weights)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--make_data", type=int, default=0, help="first write this many synthetic examples to --data")
    ap.add_argument("--vocab", type=int, default=96)
    args = ap.parse_args()
    if args.make_data:
        make_data(args.data, args.make_data, args.vocab)
    examples = read_examples(args.data)
    rng = random.Random(0)
    loss = LossConfig(loss_fn="cross_entropy", normalization="token")
    adamw = AdamWParams(lr=args.lr, weight_decay=0.01, max_grad_norm=1.0)
    epoch_means = []
    with TrainingClient(args.address) as client:
        run = client.create_run(rank=8, alpha=16, seed=1)
        print(f"run {run.run_id}: {len(examples)} examples, batch {args.batch}, {args.epochs} epochs")
        print(f"{'epoch':>5} {'step':>5} {'loss':>10} {'tokens/s':>9}")
        pending = None  # the previous batch's (forward_backward, optim_step) futures
        losses = []
        for epoch in range(args.epochs):
            rng.shuffle(examples)
            for start in range(0, len(examples), args.batch):
                datums = [to_datum(r) for r in examples[start:start + args.batch]]  # overlaps the trainer
                fb = run.forward_backward_async(datums, loss=loss)
                step = run.optim_step_async(adamw=adamw)
                if pending is not None:
                    losses.append(report(*pending))
                pending = (epoch, fb, step)
            losses.append(report(*pending))
            pending = None
            epoch_means.append(statistics.fmean(l for e, l in losses if e == epoch))
        run.close()
    print("mean loss per epoch:", " ".join(f"{m:.4f}" for m in epoch_means))
    return 0 if epoch_means[-1] < epoch_means[0] else 1


def report(epoch, fb, step):
    f, s = fb.result(), step.result()  # raises LorastepError if the call failed
    value = f.metrics["loss:sum"]
    print(f"{epoch:>5} {s.learner_version:>5} {value:>10.5f} {f.metrics.get('tokens_per_s:sum', 0):>9.0f}",
          flush=True)
    return epoch, value


if __name__ == "__main__":
    sys.exit(main())
