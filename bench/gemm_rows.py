"""The frozen GEMMs of one decoder layer at several row counts, one GEMM over all rows against
the same rows in chunks, on the GPU (cuBLAS through torch, bf16, CUDA events; the median of 10
timings of 5 repeats after a warm-up). A co-scheduled step runs its frozen GEMMs over joint
rows of 16,384 tokens or more where a run alone runs 4,096-token ones; the traces of
2026-12-04 put the joint step's GEMM time 4.5% above the lone steps' for the same tokens.
This measures each GEMM shape alone, in the forms the linears call (x @ W^T, with a bias,
accumulating into an output the low-rank product wrote first (beta 1), and backward's g @ W).
    python3 bench/gemm_rows.py --shape qwen2.5-7b --rows 4096 16384 20480 --chunks 4096 8192 \
        --out F.json [--machine M --versions V --command C]
"""
import argparse, datetime, json, statistics

import torch

SHAPES = {  # hidden, q/k/v output (q + 2 kv), intermediate
    "qwen2.5-7b": (3584, 3584 + 2 * 512, 18944),
    "qwen2.5-0.5b": (896, 896 + 2 * 128, 4864),
}


def gemms(hidden, qkv, inner):
    """name -> (input width K, output width N, form): every frozen GEMM of one layer, forward
    and backward (the input gradient), as SegmentedLoraLinear runs them."""
    return {
        "qkv_forward": (hidden, qkv, "bias"),
        "o_forward": (hidden, hidden, "plain"),
        "gate_up_forward": (hidden, 2 * inner, "accumulate"),
        "down_forward": (inner, hidden, "plain"),
        "qkv_input_grad": (qkv, hidden, "grad"),
        "o_input_grad": (hidden, hidden, "grad"),
        "gate_up_input_grad": (2 * inner, hidden, "grad"),
        "down_input_grad": (hidden, inner, "grad_accumulate"),
    }


def write_result(args, fields):
    """Writes `fields` to args.out after what every committed result file records first: when,
    on what, with which libraries, how."""
    header = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": args.machine or torch.cuda.get_device_name(), "library_versions": args.versions,
              "command": args.command}
    with open(args.out, "w") as f:
        json.dump({**header, **fields}, f, indent=2)


def timed(fn, repeats=5, timings=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(timings):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(times)


def run_gemm(k, n, form, rows, chunk):
    """Seconds for `rows` rows as chunks of `chunk` rows (chunk == rows: one GEMM)."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, k, device=dev, dtype=dt)
    if form.startswith("grad"):
        w = torch.randn(k, n, device=dev, dtype=dt) * 0.02  # g @ W, W [out, in] row-major
        right = w
    else:
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        right = w.t()  # x @ W^T through the transposed view, as at::mm(x, weight.t())
    bias = torch.randn(n, device=dev, dtype=dt)
    y = torch.randn(rows, n, device=dev, dtype=dt)
    starts = list(range(0, rows, chunk))

    def step():
        for s in starts:
            xs, ys = x[s:s + chunk], y[s:s + chunk]
            if form == "bias":
                torch.addmm(bias, xs, right, out=ys)
            elif form in ("accumulate", "grad_accumulate"):
                ys.addmm_(xs, right)  # beta 1: the low-rank product wrote ys first
            else:
                torch.mm(xs, right, out=ys)
    return timed(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384, 20480])
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default="")
    ap.add_argument("--versions", default=f"torch {torch.__version__} cuda {torch.version.cuda}")
    ap.add_argument("--command", default="python3 bench/gemm_rows.py")
    args = ap.parse_args()
    hidden, qkv, inner = SHAPES[args.shape]
    table = {}
    for rows in args.rows:
        entry = {}
        splits = [rows] + [c for c in args.chunks if c < rows and rows % c == 0]
        for chunk in splits:
            layer = 0.0
            per = {}
            for name, (k, n, form) in gemms(hidden, qkv, inner).items():
                t = run_gemm(k, n, form, rows, chunk)
                per[name] = {"seconds": t, "tflops": 2 * rows * k * n / t / 1e12}
                layer += t
            flops = sum(2 * rows * k * n for k, n, _ in gemms(hidden, qkv, inner).values())
            entry["one_gemm" if chunk == rows else f"chunks_of_{chunk}"] = {
                "layer_seconds": layer, "layer_tflops": flops / layer / 1e12, "gemms": per}
            print(f"{args.shape} rows {rows} chunk {chunk}: layer {layer * 1e3:.3f} ms, "
                  f"{flops / layer / 1e12:.0f} TFLOP/s", flush=True)
        table[str(rows)] = entry
    write_result(args, {"shape": args.shape,
                        "method": "each frozen GEMM of one decoder layer (forward and input gradient) in bf16 on "
                                  "random data, median of 10 timings of 5 repeats after 3 warm-ups, CUDA events; "
                                  "chunks: the same rows as consecutive GEMMs of that many rows",
                        "rows": table})


if __name__ == "__main__":
    main()
