"""The wide-output projections of a joint row (several runs' segments over one frozen weight),
in the forms a co-scheduled step can run them, on the GPU (bf16, CUDA events; the median of
10 timings of 5 repeats after a warm-up):
  plain:    x @ W^T alone (no branches: the floor);
  grouped:  every segment's x A^T as one batched GEMM, their wide products written into the
            output, the frozen GEMM adding into it (beta 1): SegmentedLoraLinear's grouped path;
  fold:     per segment [x | x A_s^T] @ [W | s B_s]^T, one GEMM each into its rows, over one
            [W | .] buffer whose right columns each segment overwrites in turn (the fold a run
            alone takes for gate/up, applied segment by segment);
  fold_padded (one segment: a run alone): the fold over a weight kept in a buffer `pad`
            columns wider than W (W written once; each call writes only its scaled B into the
            spare columns), the input already in its room (the norm writes it there): no copy
            of W or x per call;
  row_fold: the whole row as one K-concatenated GEMM per part over such a padded weight:
            [x | Z] @ [W | s B_1 | ... | s B_S]^T, Z holding each segment's x A_s^T in its own
            rows and its own columns, zero elsewhere (S x rank extra K for every row). Forward:
            gate and up as two GEMMs into the output's halves, each over its own parts'
            factors (S x rank/2 extra K each; up's left operand takes a copy of x). Input
            gradient: [g | Z] @ [W ; A_1 ; ... ; A_S] with Z holding each g_s s B_s (g copied
            into the left operand: autograd hands it over in its own tensor).
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


def forms(k, n, r, segments, seg_rows, grad, dev="cuda", dt=torch.bfloat16):
    """(name -> step function, y) for y[rows, n] = x[rows, k] @ right + per segment s
    (x L_s) R_s with a rank-r inner size. Forward (grad False): right = W^T of W [n, k], the
    branch x A_s^T then B_s^T. Input gradient (grad True): right = W [k, n] as stored, the
    branch g B_s then A_s [r, n]; the fold then appends A_s as rows: [g | g B_s] @ [W ; A_s]."""
    rows = segments * seg_rows
    x = torch.randn(rows, k, device=dev, dtype=dt)
    w = torch.randn(k, n, device=dev, dtype=dt) * 0.02 if grad else torch.randn(n, k, device=dev, dtype=dt) * 0.02
    right = w if grad else w.t()
    low_in = torch.randn(segments, k, r, device=dev, dtype=dt) * 0.02   # x -> rank r
    low_out = torch.randn(segments, r, n, device=dev, dtype=dt) * 0.02  # rank r -> n
    if not grad:  # gate/up: B block-diagonal (gate's columns take the first r / 2 ranks, up's the rest)
        low_out[:, :r // 2, n // 2:] = 0
        low_out[:, r // 2:, :n // 2] = 0
        # stored as the factors are: A [r, k], B [n, r]
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

    out = {"plain": plain, "grouped": grouped, "fold": fold}
    if segments == 1:  # a run alone: W and x already in their padded buffers
        right_cat[:k].copy_(right)
        x_cat[:, :k].copy_(x)

        def fold_padded():
            right_cat[k:].copy_(low_out[0])
            torch.mm(x_cat[:, :k], low_in[0], out=x_cat[:, k:])
            torch.mm(x_cat, right_cat, out=y)

        out["fold_padded"] = fold_padded
    out["row_fold"] = row_fold(x, right, low_in, low_out, y, segments, seg_rows, grad)
    return out, y


def diagonal_blocks(buf, k, segments, seg_rows, width):
    """The [segments, seg_rows, width] view of buf [rows, k + segments * width] whose block s
    is rows s * seg_rows.. and columns k + s * width.. (Z's blocks)."""
    ld = buf.stride(0)
    return buf.as_strided((segments, seg_rows, width), (seg_rows * ld + width, ld, 1), buf.storage_offset() + k)


def row_fold(x, right, low_in, low_out, y, segments, seg_rows, grad):
    """The row_fold form's step function (see the module's note); its buffers are made here,
    once, as the service would keep them: the padded weight (W written once) and the left
    operands' zeros outside the blocks."""
    dev, dt = x.device, x.dtype
    rows, k = x.shape
    n = y.shape[1]
    r = low_in.shape[2]
    if grad:  # right = W [k, n]; rows k + S r: W, then each segment's A_s [r, n]
        w_pad = torch.empty(k + segments * r, n, device=dev, dtype=dt)
        w_pad[:k].copy_(right)
        left = torch.zeros(rows, k + segments * r, device=dev, dtype=dt)
        blocks = diagonal_blocks(left, k, segments, seg_rows, r)

        def step():
            w_pad[k:].copy_(low_out.reshape(segments * r, n))
            left[:, :k].copy_(x)
            blocks.copy_(torch.bmm(x.view(segments, seg_rows, k), low_in))
            torch.mm(left, w_pad, out=y)

        return step
    # Forward: right = W^T, W [n, k] packed gate | up; each part rank r / 2 over its own half of
    # the columns (low_in's first r / 2 columns feed gate, the rest up).
    h, half = r // 2, n // 2
    w_pad = torch.empty(n, k + segments * h, device=dev, dtype=dt)  # W's rows, then S x h spare columns
    w_pad[:, :k].copy_(right.t())
    lefts = [torch.zeros(rows, k + segments * h, device=dev, dtype=dt) for _ in range(2)]
    lefts[0][:, :k].copy_(x)  # gate's left operand: x in its room, as the norm leaves it
    blocks = [diagonal_blocks(left, k, segments, seg_rows, h) for left in lefts]
    # each segment's B for its part's columns: [S, half, h] per part
    b_parts = [low_out[:, :h, :half].transpose(1, 2), low_out[:, h:, half:].transpose(1, 2)]

    def step():
        xl = torch.bmm(x.view(segments, seg_rows, k), low_in)  # [S, seg_rows, r]
        lefts[1][:, :k].copy_(x)
        for part in range(2):
            cols = slice(part * half, (part + 1) * half)
            w_pad[cols, k:].view(half, segments, h).copy_(b_parts[part].transpose(0, 1))
            blocks[part].copy_(xl[:, :, part * h:(part + 1) * h])
            torch.mm(lefts[part], w_pad[cols].t(), out=y[:, cols])

    return step



def check_forms_agree(steps, out, tol=2e-2):
    """Every form with branches writes the grouped form's output into `out` (up to `tol` of
    its largest magnitude: bf16 rounding): the timings compare the same product."""
    steps["grouped"]()
    want = out.float().clone()
    scale = want.abs().max().item()
    for name, fn in steps.items():
        if name in ("plain", "grouped"):
            continue
        out.zero_()
        fn()
        err = (out.float() - want).abs().max().item()
        if not err <= tol * scale:
            raise SystemExit(f"form {name} disagrees with grouped: max abs diff {err} (scale {scale})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--self_check", action="store_true",
                    help="only check that the forms agree, on the CPU in fp32 at small sizes (no GPU needed)")
    ap.add_argument("--machine", default="")
    ap.add_argument("--versions", default=f"torch {torch.__version__} cuda {torch.version.cuda}")
    ap.add_argument("--command", default="python3 bench/segment_fold.py")
    args = ap.parse_args()
    if args.self_check:
        for segments, seg_rows in ((1, 24), (4, 16), (3, 8)):
            for k, n, r, grad in ((32, 96, 8, False), (32, 80, 4, True)):
                steps, out = forms(k, n, r, segments, seg_rows, grad, dev="cpu", dt=torch.float32)
                check_forms_agree(steps, out, tol=1e-5)
                print(f"{segments} x {seg_rows}, k {k}, n {n}, rank {r}, {'input grad' if grad else 'forward'}: "
                      f"{', '.join(steps)} agree")
        return
    if not args.out:
        raise SystemExit("--out is required")
    table = []
    for shape, segments, seg_rows in ROWS:
        hidden, inner = SHAPES[shape]
        for proj, (k, n, r, grad) in {"gate_up_forward": (hidden, 2 * inner, 2 * RANK, False),
                                      "down_input_grad": (hidden, inner, RANK, True)}.items():
            entry = {"shape": shape, "projection": proj, "segments": segments, "rows_per_segment": seg_rows,
                     "k": k, "n": n, "rank": r, "seconds": {}}
            steps, out = forms(k, n, r, segments, seg_rows, grad)
            check_forms_agree(steps, out)
            for name, fn in steps.items():
                entry["seconds"][name] = timed(fn)
            s = entry["seconds"]
            entry["fold_vs_grouped"] = s["grouped"] / s["fold"]
            entry["row_fold_vs_grouped"] = s["grouped"] / s["row_fold"]
            print(f"{shape} {proj} {segments} x {seg_rows}: " +
                  ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in s.items()) +
                  f"; grouped/fold {entry['fold_vs_grouped']:.3f}, grouped/row_fold {entry['row_fold_vs_grouped']:.3f}", flush=True)
            table.append(entry)
            torch.cuda.empty_cache()
    write_result(args, {"method": "bf16 random data; median of 10 timings of 5 repeats after 3 warm-ups, CUDA "
                                  "events; fold includes its copies of x, W and each segment's B; fold_padded and "
                                  "row_fold copy each segment's factor into the padded weight per call, not W",
                        "rows": table})


if __name__ == "__main__":
    main()
