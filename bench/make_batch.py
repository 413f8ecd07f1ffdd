"""One RL batch for both sides of the step benchmark (bench/step_bench.sh): lorastep reads
it through bench/service_overhead.cc --batch_file, transformers through
bench/peft_step.py --batch. Random tokens; the first quarter of each sequence is prompt
(advantage 0, no loss), the rest carries advantages of +-1.
    python3 bench/make_batch.py --vocab V --workload fixed|varlen --out B.json
fixed: 64 sequences x 512 tokens (--sequences, --length). varlen: 64 sequences of 128-1024 tokens (uniform, seeded).
"""
import argparse, json, random


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--workload", choices=["fixed", "varlen"], required=True)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=512, help="fixed: tokens per sequence")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    seqs = []
    for _ in range(args.sequences):
        n = args.length if args.workload == "fixed" else rng.randint(128, 1024)
        stream = [rng.randrange(args.vocab) for _ in range(n + 1)]
        adv = [0.0 if i < n // 4 else float(rng.choice((-1, 1))) for i in range(n)]
        seqs.append({"tokens": stream[:-1], "targets": stream[1:], "advantages": adv})
    json.dump({"workload": args.workload, "seed": args.seed, "sequences": seqs}, open(args.out, "w"))
    print(args.workload, "tokens", sum(len(s["tokens"]) for s in seqs))


if __name__ == "__main__":
    main()
