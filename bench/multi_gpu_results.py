#!/usr/bin/env python3
"""Compares bench/multi_gpu.sh's traces with world size 1 and writes multi_gpu.json.

Each layout's error against world 1 is the largest of
  - every step's loss and grad_norm: |x - x1| / |x1|
  - the Forward log-probs after the last step: max |lp - lp1| / max |lp1|
  - each exported adapter tensor: ||w - w1|| / ||w1|| (Frobenius)
(each adapter tensor's max |w - w1| / max |w1| is reported beside it, not judged: AdamW
divides every element by its own RMS, so an element whose gradient nearly cancels moves by
about +-lr whatever its size, and the last-bit difference of a sum taken in another order
can flip its sign; measured even on one CPU in fp32, see tests/mesh_test.cc's Adam().)
The tolerance is stated against the bf16 floor: world 1 computing in fp32 on the same
(bf16) weights, measured against world 1 in bf16 by the same function, i.e. how far bf16
itself is from the exact result. A layout passes when each quantity's error
is at most TOL_FACTOR x max(that quantity's floor, FLOOR_MIN) and its replicas are bitwise equal after every step: a
parallel layout sums in another order (TP's row-parallel partial sums are each rounded to
bf16 before the all-reduce), so it may differ from world 1 by bf16 rounding: by the
triangle inequality, a layout as close to the exact result as world 1 is lies within twice
the floor of it (TOL_FACTOR 2). The exactness of the parallel math itself is shown in
fp32 (tests/mesh_test.cc on NCCL, bench/results/parallel_gpu.json: <= 2.3e-6).
  python3 bench/multi_gpu_results.py TRACE_DIR OUT.json --machine M --versions V --command C
"""
import argparse
import datetime
import json
import os

ERROR_MEASURE = ("per quantity, the largest relative error against world 1: every step's loss and grad_norm "
                 "|x - x1| / |x1|; the Forward log-probs after the last step max |lp - lp1| / max |lp1|; each "
                 "exported adapter tensor ||w - w1|| / ||w1|| (Frobenius; its largest element difference is "
                 "reported beside it, not judged: AdamW moves a nearly cancelling element by about +-lr)")
TOL_FACTOR = 2.0  # |layout - w1| <= |layout - exact| + |w1 - exact|: two bf16 runs, each a floor from exact
FLOOR_MIN = 1e-3  # where the floor is below this (a sum of many terms), ask for 1e-3


def load(trace_dir, name):
    path = os.path.join(trace_dir, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_safetensors(path):
    """{name: flat list or numpy array of float32} from a safetensors file (F32 or BF16)."""
    import array
    try:
        import numpy as np
    except ImportError:  # the CPU machine: Debian's python3 without numpy
        np = None
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        raw = data[e["data_offsets"][0]:e["data_offsets"][1]]
        if e["dtype"] not in ("F32", "BF16"):
            raise ValueError(f"{path}: {name}: dtype {e['dtype']} not handled")
        if e["dtype"] == "F32":
            raw32 = raw
        else:  # bf16 -> f32: the 16 bits become the high half
            h = array.array("H")
            h.frombytes(raw)
            raw32 = array.array("I", (x << 16 for x in h)).tobytes()
        out[name] = np.frombuffer(raw32, np.float32) if np else array.array("f", raw32)
    return out


def diff_norms(g, w):
    """(max |g - w|, max |w|, ||g - w||, ||w||)."""
    try:
        import numpy as np
        d = (g - w).astype(np.float64)
        w = w.astype(np.float64)
        return float(np.abs(d).max(initial=0.0)), float(np.abs(w).max(initial=0.0)), float(np.sqrt((d * d).sum())), float(np.sqrt((w * w).sum()))
    except ImportError:
        d = [a - b for a, b in zip(g, w)]
        return (max((abs(x) for x in d), default=0.0), max((abs(x) for x in w), default=0.0),
                sum(x * x for x in d) ** 0.5, sum(x * x for x in w) ** 0.5)


def adapter(trace):
    return read_safetensors(os.path.join(trace["adapter_dir"], "adapter_model.safetensors"))


def errors(got, want):
    """Largest relative error per compared quantity of `got` against `want`."""
    out = {"loss": 0.0, "grad_norm": 0.0, "logprobs": 0.0, "adapter": 0.0}
    elementwise = 0.0
    assert len(got["steps"]) == len(want["steps"]), "different step counts"
    for g, w in zip(got["steps"], want["steps"]):
        for k in ("loss", "grad_norm"):
            out[k] = max(out[k], abs(g[k] - w[k]) / max(abs(w[k]), 1e-12))
    lg, lw = got["forward_logprobs"], want["forward_logprobs"]
    assert len(lg) == len(lw), "different log-prob counts"
    out["logprobs"] = max(abs(a - b) for a, b in zip(lg, lw)) / max(max(abs(b) for b in lw), 1e-12)
    ag, aw = adapter(got), adapter(want)
    assert sorted(ag) == sorted(aw), "different adapter tensors"
    for k, w in aw.items():
        dmax, wmax, dnorm, wnorm = diff_norms(ag[k], w)
        out["adapter"] = max(out["adapter"], dnorm / max(wnorm, 1e-12))
        elementwise = max(elementwise, dmax / max(wmax, 1e-12))
    return out, elementwise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace_dir")
    p.add_argument("out")
    p.add_argument("--machine", default="")
    p.add_argument("--versions", default="")
    p.add_argument("--command", default="")
    a = p.parse_args()
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": a.machine,
        "versions": a.versions,
        "command": a.command,
        "what": "real coordinator + worker processes on NCCL (one GPU per rank), bf16, LoRA r32 on all "
                "linear layers (MoE: shared-outer expert LoRA), PPO, AdamW lr 1e-4, grad clip 1.0; each "
                "layout's steps, Forward log-probs and exported adapter against world size 1 on the same "
                "batch (bench/make_batch.py fixed: 64 x 512)",
        "error_measure": ERROR_MEASURE,
        "tolerance_rule": f"each quantity's error <= {TOL_FACTOR} x max(its bf16 floor, {FLOOR_MIN}); floor = world 1 in fp32 against world 1 in bf16",
        "layouts": {},
    }
    ok = True
    groups = [("dense", ["dp2", "tp2", "pp2"]), ("tiny_moe", ["ep2"]), ("moe", ["ep2"])]
    for model, layouts in groups:
        w1 = load(a.trace_dir, f"{model}_w1")
        if w1 is None:
            continue
        floor_trace = load(a.trace_dir, f"{model}_w1_fp32")
        floor, floor_elem = errors(floor_trace, w1) if floor_trace else (None, None)
        floor_max = max(floor.values()) if floor else 0.0
        tol = {q: TOL_FACTOR * max(floor[q] if floor else 0.0, FLOOR_MIN) for q in ("loss", "grad_norm", "logprobs", "adapter")}
        res["layouts"][f"{model}_world1"] = {"steps": w1["steps"], "tokens_per_s": w1.get("tokens_per_s"),
                                            "step_s_median": w1.get("step_s_median"), "floor": floor,
                                            "floor_max": floor_max, "floor_adapter_max_element_err": floor_elem,
                                            "tolerance": tol}
        for layout in layouts:
            t = load(a.trace_dir, f"{model}_{layout}")
            if t is None:
                ok = False
                res["layouts"][f"{model}_{layout}"] = {"missing": True}
                continue
            e, elem = errors(t, w1)
            worst = max(e.values())
            replicas = all(s["replicas_equal"] for s in t["steps"])
            passed = all(e[q] <= tol[q] for q in tol) and replicas
            ok = ok and passed
            res["layouts"][f"{model}_{layout}"] = {
                "label": t["label"], "errors": e, "max_rel_err": worst, "tolerance": tol,
                "adapter_max_element_err": elem,
                "replicas_equal_every_step": replicas, "pass": passed, "steps": t["steps"],
                "tokens_per_s": t.get("tokens_per_s"), "step_s_median": t.get("step_s_median"),
            }
            key = {"dense": f"x2_{layout}_max_rel_err", "tiny_moe": "x2_ep2_tiny_moe_max_rel_err",
                   "moe": "x2_ep2_max_rel_err"}[model]
            res[key] = worst
    if "x2_ep2_max_rel_err" not in res and "x2_ep2_tiny_moe_max_rel_err" in res:
        res["x2_ep2_max_rel_err"] = res["x2_ep2_tiny_moe_max_rel_err"]
    dw1, dp2 = res["layouts"].get("dense_world1"), res["layouts"].get("dense_dp2")
    if dw1 and dp2 and dw1.get("tokens_per_s") and dp2.get("tokens_per_s"):
        res["x2_dp2_speedup"] = dp2["tokens_per_s"] / dw1["tokens_per_s"]
        res["dp2_speedup_method"] = ("tokens/s of the whole batch over the median client-observed TrainStep "
                                     "wall time (steps after the first), DP2 against world 1, same batch")
    kill = load(a.trace_dir, "kill_dp2")
    if kill is not None:
        k = kill["kill"]
        k["rank_named"] = "rank 1" in k["message"]
        res["x2_killed_worker"] = k
        ok = ok and k["nothing_applied"] and k["rank_named"]
    res["all_pass"] = ok
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    summary = {k: v for k, v in res.items() if k.startswith("x2_") and not isinstance(v, dict)}
    for name, l in res["layouts"].items():
        if "errors" in l:
            print(f"{name}: pass {l['pass']} max_rel_err {l['max_rel_err']:.3g} errors {l['errors']} tol {l['tolerance']} "
                  f"replicas_equal {l['replicas_equal_every_step']} tok/s {l.get('tokens_per_s')}")
        elif "floor" in l:
            print(f"{name}: floor {l['floor']} tok/s {l.get('tokens_per_s')}")
    if kill is not None:
        print("killed worker:", {k: res["x2_killed_worker"][k] for k in ("code", "nothing_applied", "rank_named", "call_s")},
              res["x2_killed_worker"]["message"][:200])
    print(json.dumps(summary), "all_pass", ok)


if __name__ == "__main__":
    main()
