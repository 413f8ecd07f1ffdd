#!/usr/bin/env python3
"""Summarizes bench/autosave_cost.sh's runs into one result file.

  python3 bench/autosave_results.py RAW_DIR OUT_JSON --command "..."

Per variant (none, sync, background): the client's step times of every round, their median,
and the ratio of each journaled variant's median to the no-journal median; for the
journaled ones the autosave folder's size and how many autosaves were started.
"""
import argparse
import glob
import json
import os
import re
import statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("raw")
    parser.add_argument("out")
    parser.add_argument("--command", required=True)
    parser.add_argument("--worker", default="process", help="process, or in_process (--in_process_worker)")
    args = parser.parse_args()
    variants = {}
    first = None
    for path in sorted(glob.glob(os.path.join(args.raw, "autosave_*_*.json"))):
        match = re.match(r"autosave_(none|sync|background)_(\d+)\.json$", os.path.basename(path))
        if not match:
            continue
        data = json.load(open(path))
        first = first or data
        v = variants.setdefault(match.group(1), {"client_step_s": [], "worker_step_s": [], "rounds": []})
        v["client_step_s"] += data["client_step_s"]
        v["worker_step_s"] += data["worker_step_s"]
        store = {}
        store_path = path[:-len(".json")] + ".store.txt"
        if os.path.exists(store_path):
            for line in open(store_path):
                key, value = line.split()
                store[key] = int(value)
        v["rounds"].append({"round": int(match.group(2)), "steps": len(data["client_step_s"]), **store})
    if "none" not in variants:
        raise SystemExit(f"no autosave_none_*.json under {args.raw}")
    for v in variants.values():
        v["client_step_median_s"] = statistics.median(v["client_step_s"])
        v["worker_step_median_s"] = statistics.median(v["worker_step_s"])
    base = variants["none"]["client_step_median_s"]
    result = {
        "date": first["date"],
        "machine": first["machine"],
        "library_versions": first["library_versions"],
        "command": args.command,
        "model": first["model"],
        "worker": args.worker,
        "batch": first["batch"],
        "method": ("the same TrainSteps (one warm-up dropped per run) through a coordinator without a journal, "
                   "with autosaves every step on the step's path (--noautosave_in_background) and with "
                   "background autosaves every step (the default); runs alternate none/sync/background per "
                   "round; client wall time per step, median over all rounds"),
        "variants": variants,
        "sync_over_none": variants["sync"]["client_step_median_s"] / base if "sync" in variants else None,
        "background_over_none": variants["background"]["client_step_median_s"] / base if "background" in variants else None,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: result[k] for k in ("sync_over_none", "background_over_none")}),
          {name: round(v["client_step_median_s"] * 1e3, 2) for name, v in variants.items()},
          {name: v["rounds"] for name, v in variants.items() if name != "none"})


if __name__ == "__main__":
    main()
