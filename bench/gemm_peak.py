"""The bf16 GEMM peak that MFU is measured against, in the same run as the step benchmark:
an 8192^3 bf16 matrix product on random data through torch (cuBLAS), timed with CUDA
events; the median of 20 timings of 10 products after a warm-up.
    python3 bench/gemm_peak.py --out F.json
"""
import argparse, json, statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    t = statistics.median(times)
    out = {"gemm": f"bf16 {n}x{n}x{n}", "seconds": t, "tflops": 2 * n ** 3 / t / 1e12}
    json.dump(out, open(args.out, "w"), indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
