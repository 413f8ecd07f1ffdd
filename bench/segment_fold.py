"""The wide-output projections of a joint row (several runs' segments over one frozen weight),
in the forms a co-scheduled step can run them, on the GPU (bf16, CUDA events; the median of
10 timings of 5 repeats after a warm-up):
  plain:    x @ W^T alone (no branches: the floor);
  grouped:  every segment's x A^T as one batched GEMM, their wide products written into the
            output, the frozen GEMM adding into it (beta 1): SegmentedLoraLinear's grouped path;
  fold:     per segment [x | x A_s^T] @ [W | s B_s]^T, one GEMM each into its rows, over one
            [W | .] buffer whose right columns each segment overwrites in turn (the fold a run
            alone takes for gate/up, applied segment by segment).
For gate/up's forward (output 2 x intermediate wide) and down's input gradient (output
intermediate wide), where the output is several times wider than the input.
    python3 bench/segment_fold.py --out F.json [--machine M --versions V --command C]
"""
import argparse

import torch

from gemm_rows import timed, write_result  # the same timing as the frozen GEMMs alone

SHAPES = {  # hidden, intermediate
    "qwen2.5-7b": (3584, 18944),
    "qwen2.5-0.5b": (896, 4864),
}
# (shape, segments, rows per segment): the multi-tenant workloads' joint rows
ROWS = [("qwen2.5-7b", 4, 4096), ("qwen2.5-7b", 1, 4096), ("qwen2.5-0.5b", 16, 4096),
        ("qwen2.5-0.5b", 32, 1024), ("qwen2.5-0.5b", 1, 4096), ("qwen2.5-0.5b", 1, 1024)]
RANK = 32


def forms(k, n, r, segments, seg_rows, grad):
    """name -> step function for y[rows, n] = x[rows, k] @ right + per segment s
    (x L_s) R_s with a rank-r inner size. Forward (grad False): right = W^T of W [n, k], the
    branch x A_s^T then B_s^T. Input gradient (grad True): right = W [k, n] as stored, the
    branch g B_s then A_s [r, n]; the fold then appends A_s as rows: [g | g B_s] @ [W ; A_s]."""
    dev, dt = "cuda", torch.bfloat16
    rows = segments * seg_rows
    x = torch.randn(rows, k, device=dev, dtype=dt)
    w = torch.randn(k, n, device=dev, dtype=dt) * 0.02 if grad else torch.randn(n, k, device=dev, dtype=dt) * 0.02
    right = w if grad else w.t()
    low_in = torch.randn(segments, k, r, device=dev, dtype=dt) * 0.02   # x -> rank r
    low_out = torch.randn(segments, r, n, device=dev, dtype=dt) * 0.02  # rank r -> n
    if not grad:  # stored as the factors are: A [r, k], B [n, r]
        low_in = low_in.transpose(1, 2).contiguous().transpose(1, 2)
        low_out = low_out.transpose(1, 2).contiguous().transpose(1, 2)
    y = torch.empty(rows, n, device=dev, dtype=dt)
    x_cat = torch.empty(rows, k + r, device=dev, dtype=dt)
    w_cat = torch.empty(k + r, n, device=dev, dtype=dt) if grad else torch.empty(n, k + r, device=dev, dtype=dt)
    right_cat = w_cat if grad else w_cat.t()  # [k + r, n]

    def plain():
        torch.mm(x, right, out=y)

    def grouped():
        xl = torch.bmm(x.view(segments, seg_rows, k), low_in)
        y.view(segments, seg_rows, n).baddbmm_(xl, low_out, beta=0)
        y.addmm_(x, right)

    def fold():
        x_cat[:, :k].copy_(x)
        torch.bmm(x.view(segments, seg_rows, k), low_in, out=x_cat[:, k:].view(segments, seg_rows, r))
        right_cat[:k].copy_(right)
        for s in range(segments):
            right_cat[k:].copy_(low_out[s])
            torch.mm(x_cat[s * seg_rows:(s + 1) * seg_rows], right_cat, out=y[s * seg_rows:(s + 1) * seg_rows])

    return {"plain": plain, "grouped": grouped, "fold": fold}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default="")
    ap.add_argument("--versions", default=f"torch {torch.__version__} cuda {torch.version.cuda}")
    ap.add_argument("--command", default="python3 bench/segment_fold.py")
    args = ap.parse_args()
    table = []
    for shape, segments, seg_rows in ROWS:
        hidden, inner = SHAPES[shape]
        for proj, (k, n, r, grad) in {"gate_up_forward": (hidden, 2 * inner, 2 * RANK, False),
                                      "down_input_grad": (hidden, inner, RANK, True)}.items():
            entry = {"shape": shape, "projection": proj, "segments": segments, "rows_per_segment": seg_rows,
                     "k": k, "n": n, "rank": r, "seconds": {}}
            for name, fn in forms(k, n, r, segments, seg_rows, grad).items():
                entry["seconds"][name] = timed(fn)
            s = entry["seconds"]
            entry["fold_vs_grouped"] = s["grouped"] / s["fold"]
            print(f"{shape} {proj} {segments} x {seg_rows}: " +
                  ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in s.items()) +
                  f"; grouped/fold {entry['fold_vs_grouped']:.3f}", flush=True)
            table.append(entry)
            torch.cuda.empty_cache()
    write_result(args, {"method": "bf16 random data; median of 10 timings of 5 repeats after 3 warm-ups, CUDA "
                                  "events; fold includes its copies of x, W and each segment's B",
                        "rows": table})


if __name__ == "__main__":
    main()
