"""Whether the GPU runs a layer's frozen GEMMs slower when it runs them without pause, as a
co-scheduled step does, than in steps with short idle gaps between them, as runs served one at
a time do. On the H200 the 7B co-scheduled step's GEMMs took about 3% longer than the eight
lone steps' for the same FLOPs (docs/PERFORMANCE.md); this separates the row count from the
gaps. For several seconds each, bf16, one decoder layer's eight frozen GEMMs (forward and input
gradient, as bench/gemm_rows.py lists them) repeated over 28 layers per "step":
  rows_16384_back_to_back   16,384-row GEMMs, no pause (a joint row)
  rows_4096_back_to_back    4,096-row GEMMs, no pause
  rows_4096_gaps            4,096-row GEMMs with the GPU idle 6% of each step (a lone step)
Reported per mode: the GEMMs' TFLOP/s over the time the GPU had work (CUDA events around each
step's GEMMs), and the SM clock and board power that nvidia-smi sampled meanwhile.
    python3 bench/sustained_gemm.py --out F.json [--seconds 8] [--machine M --versions V --command C]
"""
import argparse, datetime, statistics, subprocess, tempfile, time

import torch

from gemm_rows import SHAPES, gemms, write_result

LAYERS = 28


def operands(rows, hidden, qkv, inner):
    dev, dt = "cuda", torch.bfloat16
    ops = []
    for k, n, form in gemms(hidden, qkv, inner).values():
        x = torch.randn(rows, k, device=dev, dtype=dt)
        right = (torch.randn(k, n, device=dev, dtype=dt) if form.startswith("grad")
                 else torch.randn(n, k, device=dev, dtype=dt).t()) * 0.02
        ops.append((x, right, torch.empty(rows, n, device=dev, dtype=dt), 2 * rows * k * n))
    return ops


def run_mode(ops, seconds, idle_fraction):
    """(TFLOP/s over the GEMMs' own time, wall start, wall end)."""
    flops_per_step = LAYERS * sum(f for *_, f in ops)
    busy, steps = 0.0, 0
    start = time.time()
    while time.time() - start < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(LAYERS):
            for x, right, y, _ in ops:
                torch.mm(x, right, out=y)
        end.record()
        end.synchronize()
        step = begin.elapsed_time(end) / 1e3
        busy += step
        steps += 1
        if idle_fraction > 0:
            time.sleep(step * idle_fraction / (1 - idle_fraction))
    return steps * flops_per_step / busy / 1e12, start, time.time()


def smi_samples(path):
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            rows.append((t.timestamp(), float(parts[1].split()[0]), float(parts[2].split()[0])))
        except (ValueError, IndexError):
            continue
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--machine", default="")
    ap.add_argument("--versions", default=f"torch {torch.__version__} cuda {torch.version.cuda}")
    ap.add_argument("--command", default="python3 bench/sustained_gemm.py")
    args = ap.parse_args()
    hidden, qkv, inner = SHAPES[args.shape]
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
                            "-lms", "100"], stdout=open(log, "w"), stderr=subprocess.DEVNULL)
    modes = {}
    try:
        for name, rows, idle in (("rows_16384_back_to_back", 16384, 0.0), ("rows_4096_back_to_back", 4096, 0.0),
                                 ("rows_4096_gaps", 4096, 0.06), ("rows_16384_back_to_back_again", 16384, 0.0)):
            ops = operands(rows, hidden, qkv, inner)
            run_mode(ops, 1.0, idle)  # warm-up
            tflops, t0, t1 = run_mode(ops, args.seconds, idle)
            modes[name] = {"rows": rows, "idle_fraction": idle, "tflops_while_busy": tflops, "start": t0, "end": t1}
            print(f"{name}: {tflops:.1f} TFLOP/s while busy", flush=True)
            del ops
            torch.cuda.empty_cache()
            time.sleep(2)
    finally:
        smi.terminate()
        smi.wait()
    samples = smi_samples(log)
    for name, m in modes.items():
        inside = [s for s in samples if m["start"] + 0.5 <= s[0] <= m["end"]]
        m["smi_samples"] = len(inside)
        if inside:
            m["sm_clock_mhz_mean"] = statistics.mean(s[1] for s in inside)
            m["sm_clock_mhz_min"] = min(s[1] for s in inside)
            m["power_w_mean"] = statistics.mean(s[2] for s in inside)
            m["power_w_max"] = max(s[2] for s in inside)
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in m.items() if k not in ("start", "end")},
              flush=True)
        del m["start"], m["end"]
    write_result(args, {"shape": args.shape, "seconds_per_mode": args.seconds,
                        "method": f"one decoder layer's eight frozen GEMMs (bench/gemm_rows.py) x {LAYERS} layers "
                                  "per step, bf16 random data; TFLOP/s over the steps' CUDA-event time; gaps: the "
                                  "host sleeps the given fraction of each step; nvidia-smi clocks.sm and "
                                  "power.draw every 100 ms inside each mode",
                        "modes": modes})


if __name__ == "__main__":
    main()
