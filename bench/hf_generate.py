"""The peer of bench/sampler_gpu_bench.cc: transformers `generate` with a PEFT LoRA adapter of
the same rank on the same decoder linears (q, k, v, o, gate, up, down; random factors), bf16,
SDPA attention, on the same model folder. Per batch size B: B prompts of --prompt random
tokens, exactly --new tokens each (min_new_tokens = max_new_tokens, so no early stop),
multinomial sampling at temperature 1 with nothing cut. One warm-up call first; CUDA
synchronized around each timed call. Prints one line per batch and writes --out:
    {"b{B}_wall_s": ..., "b{B}_tokens_per_s": B * new / wall, ...}
    python3 bench/hf_generate.py --model DIR --batches 1,16,64,256 --prompt 512 --new 512 --out F.json
"""
import argparse, json, time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model = get_peft_model(model, LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM", init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.01)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)

    def generate(batch, new):
        ids = torch.randint(0, vocab, (batch, args.prompt), generator=g).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        assert out.shape[1] == args.prompt + new, out.shape
        return wall

    generate(8, 8)  # warm-up
    result = {"lora_rank": args.rank, "prompt_tokens": args.prompt, "new_tokens": args.new}
    for batch in [int(b) for b in args.batches.split(",")]:
        wall = generate(batch, args.new)
        result[f"b{batch}_wall_s"] = round(wall, 4)
        result[f"b{batch}_tokens_per_s"] = round(batch * args.new / wall, 1)
        print(f"transformers generate batch {batch}: {wall:.2f} s, {batch * args.new / wall:.0f} tokens/s", flush=True)
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
