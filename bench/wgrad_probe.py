"""Probe: cost of the fused fp32-accumulating weight-gradient GEMM (aten::addmm.dtype_out,
main_grad += g^T x with bf16 inputs, fp32 C) against bf16 mm + separate fp32 add, at the
Qwen2.5-0.5B shapes of one micro-batch of 4096 tokens. Prints ms per call (CUDA events)."""
import torch

def bench(fn, n=50):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

T = 4096
for name, (out_f, in_f) in {"q/o_proj": (896, 896), "gate/up_proj": (4864, 896),
                            "down_proj": (896, 4864), "lm_head(chunk 1024)": (151936, 896)}.items():
    t = 1024 if name.startswith("lm_head") else T
    g = torch.randn(t, out_f, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, in_f, device="cuda", dtype=torch.bfloat16)
    mg = torch.zeros(out_f, in_f, device="cuda", dtype=torch.float32)
    fused = bench(lambda: torch.addmm(mg, g.t(), x, out_dtype=torch.float32, out=mg))
    split = bench(lambda: mg.add_(torch.mm(g.t(), x)))
    upcast = bench(lambda: mg.addmm_(g.t().float(), x.float()))
    flops = 2 * t * out_f * in_f
    print(f"{name:22s} fused dtype_out {fused:7.3f} ms ({flops/fused/1e9:6.1f} TFLOP/s) | "
          f"bf16 mm + add {split:7.3f} ms | fp32 upcast addmm {upcast:7.3f} ms")
