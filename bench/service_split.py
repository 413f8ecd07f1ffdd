#!/usr/bin/env python3
"""Splits each timed TrainStep of bench/service_overhead into where its overhead went, from the
client's JSON (client_start_mono_us, client_step_s, worker_step_s) and the servers' --v=2 log
(each call's duration_ms and end_mono_us on the host's monotonic clock, which every process on
one host shares). Per step, in milliseconds:
  request      the client's start to the coordinator's call start: packing, serializing and
               carrying the request until the coordinator's server sees the call
  coord_before the coordinator's call start to the worker's (a worker process only): parsing,
               checks, packing for the worker, the hop there and the worker's parse
  worker_extra the worker's call outside its step (worker process: its call less time_step_s;
               in process: the coordinator's call less the worker's step and coord_before)
  coord_after  the worker's call end to the coordinator's (the answer's hop back, records)
  answer       the coordinator's call end to the client's: the answer's way back and the
               client's parse
  service_split.py SERVICE_JSON SERVER_LOG [OUT_JSON]"""
import json
import re
import statistics
import sys

LINE = re.compile(r"component=(\w+) .*method=(\w+/\w+) code=OK duration_ms=([\d.]+) end_mono_us=(\d+)")


def calls(log, component, method):
    out = []
    for m in LINE.finditer(log):
        if m.group(1) == component and m.group(2) == method:
            end = int(m.group(4)) / 1e3
            out.append((end - float(m.group(3)), end))  # (start, end), ms
    return out


def split(result, log):
    n = len(result["client_step_s"])
    coord = calls(log, "coordinator", "Trainer/TrainStep")[-n:]
    worker = calls(log, "worker", "Worker/TrainStep")[-n:]
    if len(coord) < n or (worker and len(worker) < n):
        raise SystemExit(f"the log holds {len(coord)} coordinator and {len(worker)} worker TrainSteps, not {n}")
    rows = []
    for i in range(n):
        c_start = result["client_start_mono_us"][i] / 1e3
        c_end = c_start + result["client_step_s"][i] * 1e3
        step = result["worker_step_s"][i] * 1e3
        row = {"request": coord[i][0] - c_start, "answer": c_end - coord[i][1]}
        if worker:
            row["coord_before"] = worker[i][0] - coord[i][0]
            row["worker_extra"] = (worker[i][1] - worker[i][0]) - step
            row["coord_after"] = coord[i][1] - worker[i][1]
        else:
            row["coordinator_and_worker"] = (coord[i][1] - coord[i][0]) - step
        row["total"] = (c_end - c_start) - step
        rows.append(row)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"medians_ms": medians, "per_step_ms": rows}


def main():
    result = json.load(open(sys.argv[1]))
    out = split(result, open(sys.argv[2]).read())
    print(" ".join(f"{k} {v:.3f}" for k, v in out["medians_ms"].items()))
    if len(sys.argv) > 3:
        json.dump(out, open(sys.argv[3], "w"), indent=2)


if __name__ == "__main__":
    main()
