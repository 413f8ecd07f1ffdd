#!/usr/bin/env python3
"""Where the time between co-scheduled steps goes: reads the hop timestamps a co-scheduled
side of bench/multi_tenant.sh wrote (HOP_TRACE=DIR: DIR/NAME_coscheduled/<pid>.log, lines
"<steady ns> <hop> <run>", lib/hop_trace.h) and, for every shared step but the first two, times
each run's call from the step's end through the answer's way out and the next call's way in:

  worker_step_done -> worker_answer_out -> coordinator_worker_answered -> coordinator_out
  -> client_answered -> client_sent -> coordinator_in -> worker_call_started -> worker_queued

Per hop, over steps: the median of the step's fastest run, of its median run and of its slowest
run (ms after the step ended). Usage: hop_timeline.py DIR/NAME_coscheduled [--out F.json]
[--header OUT/NAME_coscheduled.json] (the side's bench result: its date, machine, library
versions and command head the output)
"""
import argparse
import glob
import json
import os
import statistics

HOPS = ["worker_answer_out", "coordinator_worker_answered", "coordinator_out", "client_answered", "client_sent",
        "coordinator_in", "worker_call_started", "worker_queued"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out")
    ap.add_argument("--header", help="a bench result JSON whose date, machine, library_versions and command to record")
    args = ap.parse_args()
    events = []
    for path in glob.glob(os.path.join(args.folder, "*.log")):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    events.append((int(parts[0]), parts[1], parts[2]))
    events.sort()
    by_run = {}
    for t, hop, run in events:
        by_run.setdefault((hop, run), []).append(t)
    ends = {}  # step end -> runs of that step
    for t, hop, run in events:
        if hop != "worker_step_done":
            continue
        step = next((e for e in ends if abs(t - e) < 2_000_000), None)  # one step's marks lie within 2 ms
        ends.setdefault(step if step is not None else t, []).append(run)
    steps = sorted(ends)[2:-1]  # skip the warm-up steps and the last (no next call)
    if not steps:
        raise SystemExit(f"{args.folder}: fewer than four co-scheduled steps traced")
    per_hop = {hop: {"fastest": [], "median": [], "slowest": []} for hop in HOPS}
    for end in steps:
        for hop in HOPS:
            after = []
            for run in ends[end]:
                times = [t for t in by_run.get((hop, run), []) if t >= end]
                if times:
                    after.append((times[0] - end) / 1e6)
            if after:
                per_hop[hop]["fastest"].append(min(after))
                per_hop[hop]["median"].append(statistics.median(after))
                per_hop[hop]["slowest"].append(max(after))
    summary = {hop: {k: round(statistics.median(v), 3) for k, v in d.items() if v} for hop, d in per_hop.items()}
    result = {}
    if args.header:
        with open(args.header) as f:
            head = json.load(f)
        result = {k: head.get(k, "") for k in ("date", "machine", "library_versions", "command")}
    result |= {"folder": args.folder, "steps": len(steps), "runs_per_step": statistics.median(len(ends[e]) for e in steps),
              "ms_after_step_end": summary,
              "method": "median over shared steps (all but the first two and the last) of each step's fastest, median "
                        "and slowest run at each hop, ms after the step's end (worker_step_done)"}
    print(f"{'hop':30s} {'fastest':>8s} {'median':>8s} {'slowest':>8s}  (ms after the step ended; {len(steps)} steps)")
    for hop in HOPS:
        s = summary[hop]
        print(f"{hop:30s} {s.get('fastest', 0):8.2f} {s.get('median', 0):8.2f} {s.get('slowest', 0):8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
