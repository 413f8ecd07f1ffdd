"""Causal attention on the H200 through each kernel torch offers, forward and forward +
backward, at the shapes lorastep trains: the Qwen2.5-7B shape (28 query heads, 4 KV heads,
head dim 128) at 1 x 32,768, 2 x 16,384 and 16 x 512 tokens, and the Qwen2.5-0.5B shape (14
and 2 heads, dim 64) at 16 x 512. Which kernel SDPA picks by default, and what cuDNN's
attention and the packed flash (varlen) kernel cost beside it.

  sdpa_default   F.scaled_dot_product_attention(enable_gqa=True)  (lorastep's padded rows)
  sdpa_flash     the same, restricted to the flash backend
  sdpa_cudnn     the same, restricted to cuDNN (K/V repeated to the query heads where cuDNN
                 refuses grouped heads)
  flash_varlen   aten._flash_attention_forward over packed rows (lorastep's packed rows)

Usage: python3 bench/attention_backends.py [--out FILE]. Prints one JSON object; a kernel
that refuses a shape is recorded with its error.
"""
import argparse, datetime, json, os, sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bench import timed  # CUDA-event mean after warm-ups


def case(b, s, nh, nkv, d):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, nh, s, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, nkv, s, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, nkv, s, d, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(b, nh, s, d, device=dev, dtype=dt)
    qp = q.detach().transpose(1, 2).reshape(b * s, nh, d).contiguous().requires_grad_(True)
    kp = k.detach().transpose(1, 2).reshape(b * s, nkv, d).contiguous().requires_grad_(True)
    vp = v.detach().transpose(1, 2).reshape(b * s, nkv, d).contiguous().requires_grad_(True)
    gp = g.transpose(1, 2).reshape(b * s, nh, d).contiguous()
    cu = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)

    def sdpa(backend, repeat=False):
        def run(train):
            kk, vv = (k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)) if repeat else (k, v)
            ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
            with ctx:
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not repeat)
                if train:
                    o.backward(g)
            return o
        return run

    def varlen(train):
        o = torch.ops.aten._flash_attention_forward(qp, kp, vp, cu, cu, s, s, 0.0, True, False)[0]
        if train:
            o.backward(gp)
        return o.view(b, s, nh, d).transpose(1, 2)

    kernels = {"sdpa_default": sdpa(None), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
               "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash_varlen": varlen}
    out = {}
    with torch.no_grad():
        ref = sdpa(SDPBackend.FLASH_ATTENTION)(False).float()
    for name, fn in kernels.items():
        row = {}
        try:
            try:
                with torch.no_grad():
                    o = fn(False)
            except RuntimeError:
                if name != "sdpa_cudnn":
                    raise
                fn = sdpa(SDPBackend.CUDNN_ATTENTION, repeat=True)
                row["kv_repeated"] = True
                with torch.no_grad():
                    o = fn(False)
            row["max_abs_diff_vs_flash"] = (o.float() - ref).abs().max().item()
            with torch.no_grad():
                row["forward_ms"] = timed(lambda: fn(False), iters=5, warmup=2)
            row["forward_backward_ms"] = timed(lambda: fn(True), iters=5, warmup=2)
        except RuntimeError as e:
            row["error"] = str(e).splitlines()[0][:200]
        out[name] = row
    flops_fwd = 4 * b * nh * d * s * (s + 1) / 2
    for row in out.values():
        if "forward_ms" in row:
            row["forward_tflops"] = flops_fwd / row["forward_ms"] / 1e9
            row["forward_backward_tflops"] = 3.5 * flops_fwd / row["forward_backward_ms"] / 1e9
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": torch.cuda.get_device_name(0),
              "library_versions": f"torch {torch.__version__} cuda {torch.version.cuda} cudnn {torch.backends.cudnn.version()}",
              "command": "python3 bench/attention_backends.py",
              "method": "CUDA-event mean of 5 calls after 2 warm-ups; forward_backward TFLOP/s count 3.5x the forward "
                        "(flash's backward recomputes the scores)",
              "cases": {}}
    for name, shape in [("q7b_1x32768", (1, 32768, 28, 4, 128)), ("q7b_2x16384", (2, 16384, 28, 4, 128)),
                        ("q7b_16x512", (16, 512, 28, 4, 128)), ("q05_16x512", (16, 512, 14, 2, 64))]:
        result["cases"][name] = case(*shape)
        print(name, json.dumps(result["cases"][name]), flush=True)
    if args.out:
        json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
