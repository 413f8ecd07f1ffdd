"""A random model of a named shape written by transformers itself (its config class, its
own save_pretrained: sharded safetensors and their index), on the GPU in bf16. A folder this
script wrote for the same shape (its stamp file, written last, matches) is kept; anything else
at --out is replaced.
    python3 bench/make_hf_model.py --shape qwen2.5-7b --out DIR
"""
import argparse, json, os, shutil

import torch

SHAPES = {
    # Qwen2.5-7B: 28 layers, hidden 3584, FFN 18944, 28 heads, 4 KV groups, untied head.
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # The same with Qwen2.5's long-context config: YaRN factor 4 over 32,768 -> 131,072 positions.
    "qwen2.5-7b-yarn": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768})),
    # Qwen2.5-0.5B: 24 layers, hidden 896, FFN 4864, 14 heads, 2 KV groups, tied head; YaRN as above.
    "qwen2.5-0.5b-yarn": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072,
                                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768})),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    stamp_path = os.path.join(args.out, ".make_hf_model.json")
    stamp = json.dumps({"shape": args.shape, "config": SHAPES[args.shape], "seed": 0}, sort_keys=True)
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return
    shutil.rmtree(args.out, ignore_errors=True)
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kwargs = SHAPES[args.shape]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out, max_shard_size="4GB", safe_serialization=True)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    print("wrote", args.out, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()
