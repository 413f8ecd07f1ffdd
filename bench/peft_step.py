"""The peer: one RL train step with Hugging Face transformers (+ PEFT LoRA), for a
side-by-side comparison with lorastep in the same run.

64 sequences x 512 tokens, micro-batch 8, bf16, SDPA, PPO loss (on-policy ratio),
torch.optim.AdamW; LoRA r32 alpha 32 on q,k,v,o,gate,up,down, or full fine-tuning, or
(fwdbwd) the model's own forward + backward with no optimizer (the MoE benchmark's peer).
Reports the median of --steps timed steps after one warm-up (CUDA synchronized).
    python3 bench/peft_step.py --model DIR --mode lora|full|fwdbwd --out F.json
"""
import argparse, json, statistics, time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["lora", "full", "fwdbwd"], required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda()
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=32, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (64, 513), generator=g).cuda()
    adv = (torch.randint(0, 2, (64, 512), generator=g).float() * 2 - 1).cuda()
    adv[:, :128] = 0  # prompt positions carry no loss

    def step():
        n_tokens = (adv != 0).sum()
        for mb in range(0, 64, 8):
            x = tokens[mb:mb + 8, :-1]
            y = tokens[mb:mb + 8, 1:]
            logits = model(input_ids=x).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())
            a = adv[mb:mb + 8]
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
           "mode": args.mode, "step_s": statistics.median(times), "step_s_all": times,
           "tokens_per_s": 64 * 512 / statistics.median(times),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
           "trainable_params": sum(p.numel() for p in params)}
    json.dump(out, open(args.out, "w"), indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
