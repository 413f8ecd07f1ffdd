"""Summarizes a Kineto Chrome trace of one train step (LORASTEP_PROFILE_TRACE, see
bench/step_bench.sh) into a short JSON: wall time of the traced region, GPU busy time (the
union of kernel intervals), kernel launches, time by kernel class, and the top kernels;
and the host side: where the GPU waited for the CPU (a kernel launched after the previous
one had finished), and the CPU ops with the most self time on the launching threads (the
profiler slows the host, so compare these between runs, not with untraced step times).
    python3 bench/profile_summary.py TRACE.json --out SUMMARY.json [--label L]
"""
import argparse, collections, json, re

CLASSES = [  # first match wins
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|splitk", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("softmax/reduce", re.compile(r"softmax|reduce|logsumexp|norm", re.I)),
    ("copy/cast", re.compile(r"copy|cast|convert|memcpy|memset|fill", re.I)),
    ("index/gather", re.compile(r"index|gather|scatter|embedding", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
]


def kernel_class(name):
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def host_side(events, kernels, top):
    """GPU time lost waiting for launches, and CPU ops by self time."""
    launch_ts = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"] + e["dur"]
    starved, gaps, prev_end = 0.0, 0, None
    for k in sorted(kernels, key=lambda e: e["ts"]):
        launched = launch_ts.get(k.get("args", {}).get("correlation"))
        if prev_end is not None and k["ts"] > prev_end and launched is not None and launched > prev_end:
            # idle from the previous kernel's end until this one's launch returned: the CPU was late
            starved += min(k["ts"], launched) - prev_end
            gaps += 1
        prev_end = k["ts"] + k["dur"] if prev_end is None else max(prev_end, k["ts"] + k["dur"])
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    by_tid = collections.defaultdict(list)
    for e in ops:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    self_time = collections.defaultdict(lambda: [0, 0.0])

    def close(item):  # [end, name, child time, duration]
        _, name, child, dur = item
        self_time[name][0] += 1
        self_time[name][1] += dur - child

    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                close(stack.pop())
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        while stack:
            close(stack.pop())
    ranked = sorted(self_time.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "gpu_starved_ms": round(starved / 1e3, 3),
        "gpu_starved_gaps": gaps,
        "cpu_ops": len(ops),
        "cpu_op_self_ms": round(sum(v[1] for v in self_time.values()) / 1e3, 3),
        "top_cpu_ops_self": [{"name": n[:100], "calls": v[0], "self_ms": round(v[1] / 1e3, 3)} for n, v in ranked],
    }


def idle_gaps(events, intervals, begin, end, top):
    """The longest stretches with no kernel running (before the first, between, after the
    last), each with the CPU ops open at its middle (outermost first): what the host was doing
    while the GPU waited."""
    gaps, cursor = [], begin
    for s, e in intervals:
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if end > cursor:
        gaps.append((cursor, end))
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    out = []
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        mid = (s + e) / 2
        open_ops = sorted((o for o in ops if o["ts"] <= mid <= o["ts"] + o["dur"]), key=lambda o: (o["ts"], -o["dur"]))
        out.append({"start_ms": round((s - begin) / 1e3, 3), "ms": round((e - s) / 1e3, 3),
                    "host_ops": [o["name"][:80] for o in open_ops[:6]]})
    return {"gpu_idle_ms": round(sum(e - s for s, e in gaps) / 1e3, 3), "gpu_idle_gaps": len(gaps),
            "longest_idle_gaps": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--machine", default="")
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    events = json.load(open(args.trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    begin = min(e["ts"] for e in timed)
    end = max(e["ts"] + e["dur"] for e in timed)
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_class = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
        by_class[kernel_class(e["name"])][0] += 1
        by_class[kernel_class(e["name"])][1] += e["dur"]
    total = sum(v[1] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]
    host = host_side(events, kernels, args.top)
    host.update(idle_gaps(events, intervals, begin, end, 12))
    import datetime
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": args.machine,
        "command": args.command or "python3 bench/profile_summary.py " + args.trace,
        "label": args.label,
        "traced_wall_ms": (end - begin) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_fraction": busy / (end - begin),
        "kernel_launches": len(kernels),
        "kernel_time_ms": total / 1e3,
        "by_class_ms": {k: round(v[1] / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1][1])},
        "by_class_launches": {k: v[0] for k, v in by_class.items()},
        "top_kernels": [{"name": n[:140], "calls": v[0], "ms": round(v[1] / 1e3, 3),
                         "share": round(v[1] / total, 4)} for n, v in top],
        **host,
    }
    json.dump(out, open(args.out, "w"), indent=2)
    print(json.dumps({k: out[k] for k in ("label", "traced_wall_ms", "gpu_busy_ms", "gpu_busy_fraction",
                                          "kernel_launches", "by_class_ms")}))
    print(json.dumps({k: out[k] for k in ("gpu_starved_ms", "gpu_starved_gaps", "cpu_ops", "cpu_op_self_ms")}))
    for k in out["top_cpu_ops_self"][:15]:
        print(f"  cpu {k['self_ms']:9.2f} ms {k['calls']:6d}x  {k['name'][:100]}")
    for k in out["top_kernels"][:12]:
        print(f"  {k['ms']:9.2f} ms {k['calls']:6d}x  {k['name'][:100]}")
    print(f"  gpu idle {out['gpu_idle_ms']:.2f} ms in {out['gpu_idle_gaps']} gaps; longest:")
    for g in out["longest_idle_gaps"][:6]:
        print(f"    at {g['start_ms']:9.2f} ms for {g['ms']:7.2f} ms  {' > '.join(g['host_ops'][:4])}")


if __name__ == "__main__":
    main()
