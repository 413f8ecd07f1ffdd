#!/usr/bin/env python3
"""Puts one `scripts/bench.py ... suite service` call's figures into bench/results/step.json:
service_overhead_lora (the default deployment's median overhead), service_overhead_deployment,
the other deployments' figures beside it, and service_overhead_source (each deployment's raw
per-step figures and, with --service-log, the split of bench/service_split.py). The figures it
replaces move into service_overhead_source.before (date, commit, headline fractions).
  service_results.py RESULTS_DIR STEP_JSON --commit C --command CMD [--raw RAW_DIR]
                     [--repeat DIR --repeat-command CMD]...
RESULTS_DIR holds service_overhead_<deployment>[_v2].json; RAW_DIR (default RESULTS_DIR)
holds service_<deployment>_v2.server.log (the --v=2 pass's server log) where the split
JSONs did not come back. Each --repeat DIR is a later call on the same code: its deployments'
figures go under service_overhead_source.repeats, and service_overhead_lora_calls lists the
default deployment's figure of every call (the headline is the first call's)."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import service_split  # noqa: E402

DEPLOYMENTS = ("process", "process_grpc", "in_process", "process_cold_poller", "process_sleeping",
               "process_random_targets")
DEFAULT = "process"  # what the README starts: the coordinator spawns its worker process
DEPLOYMENT_NOTES = (
    "process: the coordinator spawns its worker, whose per-step calls travel over the call pipe (the default); "
    "process_grpc: the same with --noworker_pipe (the second gRPC hop); process_cold_poller: without the gRPC "
    "poller kept warm after answers; process_sleeping: nor any caller polling for its answer; "
    "process_random_targets: the default deployment sent a batch whose targets are random tokens of their own "
    "(sent whole) instead of the tokens shifted by one, as an RL rollout's are (each call's batch is under its "
    "deployment's batch); in_process: lorastep_coordinator_with_worker --in_process_worker")


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("step_json")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--raw", help="folder with the --v=2 server logs (default: RESULTS)")
    ap.add_argument("--repeat", action="append", default=[], help="a later call's results folder (same code)")
    ap.add_argument("--repeat-command", action="append", default=[], help="the command of each --repeat call")
    args = ap.parse_args()
    raw = args.raw or args.results
    per = {}
    for d in DEPLOYMENTS:
        path = os.path.join(args.results, f"service_overhead_{d}.json")
        if os.path.exists(path):
            per[d] = load(path)
    if DEFAULT not in per:
        raise SystemExit(f"{args.results}: no service_overhead_{DEFAULT}.json (the default deployment)")
    splits = {}
    for d in per:
        split_json = os.path.join(args.results, f"service_split_{d}.json")
        v2 = os.path.join(args.results, f"service_overhead_{d}_v2.json")
        log = os.path.join(raw, f"service_{d}_v2.server.log")
        if os.path.exists(split_json):
            splits[d] = load(split_json)["medians_ms"]
        elif os.path.exists(v2) and os.path.exists(log):
            with open(log) as f:
                splits[d] = service_split.split(load(v2), f.read())["medians_ms"]
    step = load(args.step_json)
    old = step.get("service_overhead_source")
    before = []
    if old:
        before = old.pop("before", [])
        before.append({"date": old.get("date"), "commit": old.get("commit"),
                       **{d: {k: old[d][k] for k in ("overhead_fraction", "worker_step_median_s") if k in old[d]}
                          for d in DEPLOYMENTS if d in old}})
    first = per[DEFAULT]
    source = {"date": first.get("date"), "machine": first.get("machine"), "versions": first.get("versions") or first.get("library_versions"),
              "commit": args.commit, "command": args.command}
    for d, r in per.items():
        source[d] = {k: r[k] for k in ("overhead_fraction", "worker_step_median_s", "overhead_fractions",
                                       "client_minor_faults", "batch") if k in r}
    if splits:
        source["split_medians_ms"] = splits
        source["split"] = (old or {}).get("split", "bench/service_split.py over the --v=2 pass of the same call")
    source["deployments"] = DEPLOYMENT_NOTES
    source["method"] = first.get("method", (old or {}).get("method"))
    source["before"] = before
    step["service_overhead_lora"] = first["overhead_fraction"]
    step["service_overhead_deployment"] = DEFAULT
    for d in DEPLOYMENTS:  # beside the headline: this call's deployments only (older ones are under before)
        if d != DEFAULT:
            if d in per:
                step[f"service_overhead_lora_{d}"] = per[d]["overhead_fraction"]
            else:
                step.pop(f"service_overhead_lora_{d}", None)
    if len(args.repeat_command) != len(args.repeat):
        raise SystemExit("each --repeat needs its --repeat-command")
    repeats = []
    for folder, command in zip(args.repeat, args.repeat_command):
        runs = {d: load(os.path.join(folder, f"service_overhead_{d}.json")) for d in DEPLOYMENTS
                if os.path.exists(os.path.join(folder, f"service_overhead_{d}.json"))}
        if DEFAULT not in runs:
            raise SystemExit(f"{folder}: no service_overhead_{DEFAULT}.json (the default deployment)")
        repeats.append({"date": runs[DEFAULT].get("date"), "command": command,
                        **{d: {k: r[k] for k in ("overhead_fraction", "worker_step_median_s", "overhead_fractions")
                               if k in r} for d, r in runs.items()}})
    if repeats:
        source["repeats"] = repeats
        step["service_overhead_lora_calls"] = [first["overhead_fraction"]] + [r[DEFAULT]["overhead_fraction"]
                                                                             for r in repeats]
    else:
        step.pop("service_overhead_lora_calls", None)
    step["service_overhead_source"] = source
    # The target is the default deployment's (the step suite's own figures are its rows').
    step.setdefault("ratios", {})["service_overhead_lora (target < 0.01)"] = first["overhead_fraction"]
    with open(args.step_json, "w") as f:
        json.dump(step, f, indent=2)
        f.write("\n")
    print(" ".join(f"{d} {per[d]['overhead_fraction']:.4f}" for d in per))
    for d, s in splits.items():
        print(d, " ".join(f"{k} {v:.3f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
