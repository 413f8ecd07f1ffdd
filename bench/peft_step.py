"""The peer: one RL train step with Hugging Face transformers (+ PEFT LoRA), for a
side-by-side comparison with lorastep in the same run.

bf16, SDPA, PPO loss (on-policy ratio), torch.optim.AdamW, grad clip 1.0; LoRA r32 alpha
32 on q,k,v,o,gate,up,down (lora), full fine-tuning (full), the model's own forward +
backward with no optimizer (fwdbwd: the MoE benchmark's peer), or forward-only log-probs of
the targets with the full model (logprobs). Micro-batches of --micro sequences, right-padded
to the longest in the micro-batch (transformers' usual batching) with an attention mask.
The batch: --batch B.json (bench/make_batch.py, the same one lorastep runs) or 64 random
sequences x 512. Reports the median of --steps timed steps after one warm-up (CUDA
synchronized) and the CUDA peak memory of the timed steps.
    python3 bench/peft_step.py --model DIR --mode lora|full|fwdbwd|logprobs [--batch B.json] --out F.json
"""
import argparse, json, statistics, time

import torch


def load_batch(path, vocab):
    if path:
        seqs = json.load(open(path))["sequences"]
        return [(torch.tensor(s["tokens"]), torch.tensor(s["targets"]), torch.tensor(s["advantages"]))
                for s in seqs]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (64, 513), generator=g)
    adv = torch.randint(0, 2, (64, 512), generator=g).float() * 2 - 1
    adv[:, :128] = 0  # prompt positions carry no loss
    return [(tokens[i, :-1], tokens[i, 1:], adv[i]) for i in range(64)]


def pad(rows, value):
    n = max(r.numel() for r in rows)
    out = torch.full((len(rows), n), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def lora_targets(model_type):
    """PEFT's targets for lorastep's all-linear LoRA of this family: every projection; gpt-oss's
    experts through target_parameters (PEFT's form for its stored expert tensors); Qwen3.5's
    Gated DeltaNet projections besides attention and MLP."""
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if model_type == "gpt_oss":
        return {"target_modules": attention,
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if model_type.startswith("qwen3_5"):
        return {"target_modules": attention + mlp + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                     "out_proj"]}
    return {"target_modules": attention + mlp}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["lora", "full", "fwdbwd", "logprobs"], required=True)
    ap.add_argument("--batch", default="")
    ap.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from hf_parity import attn_implementation
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 attn_implementation=attn_implementation(args.model)).cuda()
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 **lora_targets(model.config.model_type)))
    model.train(args.mode != "logprobs")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)
    data = load_batch(args.batch, model.config.vocab_size)
    micro = []
    for mb in range(0, len(data), args.micro):
        part = data[mb:mb + args.micro]
        x = pad([p[0] for p in part], 0).cuda()
        y = pad([p[1] for p in part], 0).cuda()
        mask = pad([torch.ones_like(p[0]) for p in part], 0).cuda()
        a = pad([p[2] for p in part], 0.0).cuda()
        micro.append((x, y, mask, a))
    n_tokens = sum(int((m[3] != 0).sum()) for m in micro)
    batch_tokens = sum(p[0].numel() for p in data)

    def step():
        if args.mode == "logprobs":
            with torch.no_grad():
                for x, y, mask, _ in micro:
                    logits = model(input_ids=x, attention_mask=mask).logits.float()
                    torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
            return
        for x, y, mask, a in micro:
            logits = model(input_ids=x, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())
            pg = torch.max(-ratio * a, -ratio.clamp(0.8, 1.28) * a)
            (pg * (a != 0)).sum().div(n_tokens).backward()
        if args.mode == "fwdbwd":
            opt.zero_grad(set_to_none=True)
            return
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    import datetime, sys, transformers
    out = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
           "machine": torch.cuda.get_device_name(), "command": "python3 " + " ".join(sys.argv),
           "mode": args.mode, "batch": args.batch or "64 x 512 random", "micro": args.micro, "batch_tokens": batch_tokens,
           "padded_tokens": sum(m[0].numel() for m in micro),
           "step_s": statistics.median(times), "step_s_all": times,
           "tokens_per_s": batch_tokens / statistics.median(times),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
           "trainable_params": sum(p.numel() for p in params), "model_type": model.config.model_type}
    json.dump(out, open(args.out, "w"), indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "step_s_all"}))


if __name__ == "__main__":
    main()
