"""An RL orchestrator loop against a running lorastep coordinator (GRPO-style).

Synthetic rollouts stand in for a sampler: each prompt gets a group of responses; a
response's reward is its share of "good" tokens (ids below vocab/8). Advantages are
group-normalized (GRPO), old log-probs come from a Forward pass, and one TrainStep per
rollout batch applies PPO. The table shows the mean log-prob the policy gives good tokens
rising step by step; at the end the adapter is exported in PEFT format.

    python3 examples/grpo_loop.py --address 127.0.0.1:50051 --vocab 512 --steps 8
"""
import argparse
import random
import statistics
import sys

from lorastep import TrainingClient


def rollouts(rng, vocab, prompts=8, group=8, prompt_len=16, response_len=48):
    good_below = vocab // 8
    batch = []
    for p in range(prompts):
        group_items = []
        for _ in range(group):
            rate = rng.random()
            seq = [(p * 31 + i * 7) % vocab for i in range(prompt_len)]
            good = 0
            for _ in range(response_len):
                if rng.random() < rate:
                    seq.append(rng.randrange(good_below))
                    good += 1
                else:
                    seq.append(rng.randrange(good_below, vocab))
            datum = {
                "tokens": seq[:-1],
                "target_tokens": seq[1:],
                "weights": [0.0] * (prompt_len - 1) + [1.0] * response_len,  # response only
            }
            group_items.append((datum, good / response_len))
        rewards = [r for _, r in group_items]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for datum, r in group_items:
            datum["advantages"] = [(r - mean) / (std + 1e-6)] * len(datum["tokens"])
            batch.append((datum, r))
    return batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--export", default="")
    args = ap.parse_args()
    rng = random.Random(7)
    client = TrainingClient(args.address)
    run = client.create_run(rank=16, alpha=32, seed=0)
    loss = {"loss_fn": "ppo", "clip_eps_low": 0.2, "clip_eps_high": 0.28}
    adamw = {"lr": 2e-3, "beta2": 0.98, "weight_decay": 0.1, "max_grad_norm": 1.0}
    good_below = args.vocab // 8
    print(f"run {run.run_id}")
    print(f"{'step':>4} {'loss':>10} {'reward':>8} {'clipfrac':>9} {'ppo_kl':>10} "
          f"{'grad_norm':>9} {'tokens/s':>9} {'good_logprob':>13}")
    first = last = None
    for step in range(args.steps):
        batch = rollouts(rng, args.vocab)
        datums = [d for d, _ in batch]
        old = run.forward(datums)["logprobs"]  # re-score old log-probs (the trainer's own)
        good = []
        for d, lp in zip(datums, old):
            d["logprobs"] = lp
            good += [x for x, t, w in zip(lp, d["target_tokens"], d["weights"])
                     if w > 0 and t < good_below]
        good_lp = statistics.fmean(good)
        first = good_lp if first is None else first
        last = good_lp
        reward = statistics.fmean(r for _, r in batch)
        # The orchestrator's figures go into the run's step history (client:reward, ...), so
        # `lorastep plot` and the metrics endpoint show them beside the trainer's.
        out = run.train_step(datums, loss=loss, adamw=adamw,
                             client_metrics={"reward": reward, "good_logprob": good_lp})
        m = out["metrics"]
        print(f"{step:>4} {m['loss:sum']:>10.5f} {reward:>8.4f} "
              f"{m['pg_clipfrac:mean']:>9.5f} {m['ppo_kl:mean']:>10.6f} {m['grad_norm:sum']:>9.4f} "
              f"{m['tokens_per_s:sum']:>9.0f} {good_lp:>13.4f}", flush=True)
    if args.export:
        e = run.export(args.export)
        print(f"adapter exported to {e['path']} (PEFT), sha256 {e['adapter_sha256']}")
    print(f"good-token log-prob: {first:.4f} -> {last:.4f}")
    client.close()
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main())
