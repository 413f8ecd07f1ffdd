"""An RL loop that closes on lorastep alone (GRPO-style): the policy samples its own rollouts
through the service, a verifiable reward scores them, and the same service trains on them.

Each step: prompts of random token ids; `--group` completions per prompt sampled from the
run's current adapter (Run.sample; the prompt is prefilled once for its group); reward = the
share of a completion's tokens that are "good" (ids below vocab/8: a rule the example checks,
which a tiny random model learns within a few steps); advantages normalized within each
group (GRPO); the sampler's own log-probs as the old log-probs of a PPO TrainStep. Printed per
step: mean reward (rising), the train/sample log-prob mismatch (max and mean |Forward -
sampler| over the sampled tokens: ~0, the sampler's log-probs are the trainer's), tokens
sampled per second, and the step's training metrics. The reward and the mismatch go into
the run's step history (client:*), so `lorastep plot` draws them.

    python3 examples/grpo_loop.py --address 127.0.0.1:50051 --vocab 512 --steps 8
"""
import argparse
import random
import statistics
import sys
import time

from lorastep import SamplingParams, TrainingClient


def group_advantages(rewards):
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=12)
    ap.add_argument("--response_len", type=int, default=24)
    ap.add_argument("--export", default="")
    args = ap.parse_args()
    rng = random.Random(7)
    client = TrainingClient(args.address)
    run = client.create_run(rank=16, alpha=32, seed=0, train_unembed=True)  # LoRA on the LM head too
    loss = {"loss_fn": "ppo", "clip_eps_low": 0.2, "clip_eps_high": 0.28}
    adamw = {"lr": 5e-2, "beta2": 0.98, "max_grad_norm": 1.0}
    good_below = args.vocab // 8
    print(f"run {run.run_id}")
    print(f"{'step':>4} {'reward':>8} {'mismatch_max':>12} {'mismatch_mean':>13} {'sampled/s':>9} "
          f"{'loss':>10} {'clipfrac':>9} {'ppo_kl':>10} {'grad_norm':>9} {'train tok/s':>11}")
    first = last = None
    for step in range(args.steps):
        prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        t0 = time.perf_counter()
        sampled = run.sample(prompts, num_samples=args.group,
                             params=SamplingParams(max_tokens=args.response_len, temperature=1.0,
                                                   seed=rng.randrange(1 << 31)))
        sample_s = time.perf_counter() - t0
        datums, rewards, sampler_lps = [], [], []
        for prompt, group in zip(prompts, sampled.sequences):
            group_rewards = [sum(t < good_below for t in s.tokens) / len(s.tokens) for s in group]
            for s, adv in zip(group, group_advantages(group_rewards)):
                seq = prompt + s.tokens
                n_prompt = len(prompt) - 1  # target positions that predict prompt tokens
                datums.append({
                    "tokens": seq[:-1],
                    "target_tokens": seq[1:],
                    "weights": [0.0] * n_prompt + [1.0] * len(s.tokens),   # the completion only
                    "logprobs": [0.0] * n_prompt + list(s.logprobs),        # the sampler's: old log-probs
                    "advantages": [adv] * (len(seq) - 1),
                })
                sampler_lps.append(s.logprobs)
            rewards += group_rewards
        # The mismatch: the trainer's log-probs of the sampled tokens against the sampler's.
        trainer = run.forward(datums).logprobs
        diffs = [abs(a - b) for d, lp, slp in zip(datums, trainer, sampler_lps)
                 for a, b in zip(lp[len(d["tokens"]) - len(slp):], slp)]
        mismatch_max, mismatch_mean = max(diffs), statistics.fmean(diffs)
        tokens_sampled = sum(len(x) for x in sampler_lps)
        reward = statistics.fmean(rewards)
        first = reward if first is None else first
        last = reward
        out = run.train_step(datums, loss=loss, adamw=adamw, client_metrics={
            "reward": reward, "mismatch_max": mismatch_max, "mismatch_mean": mismatch_mean,
            "sampled_tokens_per_s": tokens_sampled / sample_s})
        m = out.metrics
        print(f"{step:>4} {reward:>8.4f} {mismatch_max:>12.2e} {mismatch_mean:>13.2e} {tokens_sampled / sample_s:>9.0f} "
              f"{m['loss:sum']:>10.5f} {m['pg_clipfrac:mean']:>9.5f} {m['ppo_kl:mean']:>10.6f} "
              f"{m['grad_norm:sum']:>9.4f} {m['tokens_per_s:sum']:>11.0f}", flush=True)
    if args.export:
        e = run.export(args.export)
        print(f"adapter exported to {e['path']} (PEFT), sha256 {e['adapter_sha256']}")
    print(f"mean reward: {first:.4f} -> {last:.4f}")
    client.close()
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main())
