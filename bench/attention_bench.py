"""Causal attention forward+backward on the H200 at the Qwen2.5-0.5B shape (14 query heads,
2 KV heads, head dim 64, bf16): which call lorastep's layer should make.

  (a) K/V repeated to 14 heads, then SDPA           (lorastep's layer before this bench)
  (b) SDPA with enable_gqa=True                      (no repeat)
  (c) flash attention, packed varlen, native GQA    (aten._flash_attention_forward)

Usage: python3 bench/attention_bench.py [--out FILE]. Prints one JSON object.
"""
import argparse
import datetime
import json
import platform

import torch
import torch.nn.functional as F


def timed(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    b, s, nh, nkv, d = 16, 512, 14, 2, 64
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, nh, s, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, nkv, s, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, nkv, s, d, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(b, nh, s, d, device=dev, dtype=dt)

    def repeat():
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1),
                                           is_causal=True)
        o.backward(g)
        return o

    def gqa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(g)
        return o

    # Packed: [b*s, heads, d] with cumulative sequence starts.
    qp = q.detach().transpose(1, 2).reshape(b * s, nh, d).contiguous().requires_grad_(True)
    kp = k.detach().transpose(1, 2).reshape(b * s, nkv, d).contiguous().requires_grad_(True)
    vp = v.detach().transpose(1, 2).reshape(b * s, nkv, d).contiguous().requires_grad_(True)
    gp = g.transpose(1, 2).reshape(b * s, nh, d).contiguous()
    cu = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)

    def flash_varlen():
        o = torch.ops.aten._flash_attention_forward(qp, kp, vp, cu, cu, s, s, 0.0, True, False)[0]
        o.backward(gp)
        return o

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(0),
        "library_versions": f"torch {torch.__version__} cuda {torch.version.cuda}",
        "command": "python3 bench/attention_bench.py",
        "shape": {"batch": b, "seq": s, "heads": nh, "kv_heads": nkv, "head_dim": d, "dtype": "bf16"},
    }
    ref = repeat().detach()
    for name, fn in [("repeat_sdpa_ms", repeat), ("sdpa_enable_gqa_ms", gqa), ("flash_varlen_ms", flash_varlen)]:
        try:
            out = fn().detach()
            if out.shape != ref.shape:
                out = out.view(b, s, nh, d).transpose(1, 2)
            result[name] = timed(fn)
            result[name.replace("_ms", "_max_abs_diff")] = (out.float() - ref.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - record what this torch lacks
            result[name] = None
            result[name.replace("_ms", "_error")] = str(e)[:300]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
