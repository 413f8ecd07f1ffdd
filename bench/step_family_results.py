"""Turns bench/step_family.sh's raw files into OUT_DIR/step_PREFIX.json: lorastep's and
transformers + PEFT's LoRA step on the same model and batch, their tokens/s ratio and peak
memory, and for a Qwen3.5 model the Gated DeltaNet mixer's share of lorastep's step (the
mixer's forward + backward per micro-batch without its projections, timed with the rule run
again in backward and with its intermediates kept, as many of each as the step's metrics
report, times the linear layers, over the step's median time); for gpt-oss also lorastep's
step with LORASTEP_SINK_FLASH=0 LORASTEP_FUSED_CLAMPED_SWIGLU=0 (`*_composed_paths` keys: the
explicit sink mask and ATen's clamped SwiGLU in place of the default kernels).
    python3 bench/step_family_results.py RAW_DIR MODEL_DIR PRESET PREFIX [--micro_batch N]
"""
import argparse, json, math, os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("model")
    ap.add_argument("preset")
    ap.add_argument("prefix")
    ap.add_argument("--micro_batch", type=int, default=8192)
    args = ap.parse_args()
    raw = lambda name: json.load(open(os.path.join(args.raw, name)))
    p = args.prefix
    ours, hf = raw(f"{p}_ours_lora.json"), raw(f"{p}_hf_lora.json")
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    env = open(os.path.join(args.raw, "env.txt")).read().splitlines()
    tokens = sum(len(s["tokens"]) for s in raw(f"batch_{p}.json")["sequences"])
    out = {f"{p}_source": {"date": ours["date"] if "date" in ours else hf["date"], "machine": env[0],
                           "library_versions": env[-1], "commit": env[1],
                           "command": f"python3 scripts/bench.py suite step-families (bench/step_family.sh BUILD OUT {args.preset} {p})",
                           "model": f"{args.preset} (random, bf16): {cfg['num_hidden_layers']} layers, model_type {cfg['model_type']}",
                           "batch": f"64 x 512 tokens ({tokens}), micro-batch {args.micro_batch} tokens; transformers: {hf.get('micro', 8)} sequences per micro-batch",
                           "lora": "r32 on every projection (MoE experts per expert; PEFT: bench/peft_step.py lora_targets)"},
           f"{p}_lora_step_s_ours": ours["worker_step_median_s"], f"{p}_lora_step_s_peft": hf["step_s"],
           f"{p}_lora_tokens_per_s_ours": tokens / ours["worker_step_median_s"],
           f"{p}_lora_tokens_per_s_peft": hf["tokens_per_s"],
           f"{p}_lora_tokens_per_s_over_peft": hf["step_s"] / ours["worker_step_median_s"],
           f"{p}_lora_peak_gib_ours": ours.get("peak_cuda_gib"), f"{p}_lora_peak_gib_peft": hf["peak_memory_gib"]}
    composed_paths = os.path.join(args.raw, f"{p}_ours_lora_composed_paths.json")
    if os.path.exists(composed_paths):  # the A/B: LORASTEP_SINK_FLASH=0 LORASTEP_FUSED_CLAMPED_SWIGLU=0
        composed = json.load(open(composed_paths))
        out[f"{p}_lora_step_s_ours_composed_paths"] = composed["worker_step_median_s"]
        out[f"{p}_lora_tokens_per_s_over_peft_composed_paths"] = hf["step_s"] / composed["worker_step_median_s"]
        out[f"{p}_lora_peak_gib_ours_composed_paths"] = composed.get("peak_cuda_gib")
    gdn = os.path.join(args.raw, f"{p}_gdn.json")
    if os.path.exists(gdn):
        g = json.load(open(gdn))
        linear = sum(1 for t in cfg.get("layer_types", []) if t == "linear_attention")
        # The step's micro-batches and how many ran the rule again in backward (the rest kept
        # its intermediates): each costs the mixer as gated_delta_bench times it that way.
        # Without the kept rule's timing every micro-batch counts as recomputing it.
        metrics = ours.get("last_step_metrics", {})
        micro = int(metrics.get("micro_batches:sum", math.ceil(tokens / args.micro_batch)))
        keep_rule = os.path.join(args.raw, f"{p}_gdn_keep_rule.json")
        kept_ms = json.load(open(keep_rule))["mixer_without_projections_ms"] if os.path.exists(keep_rule) else None
        recomputed = int(metrics.get("micro_batches_rule_recomputed:sum", micro)) if kept_ms is not None else micro
        kept = micro - recomputed
        mixer_ms = g["mixer_without_projections_ms"]
        per_step = (recomputed * mixer_ms + kept * (kept_ms or 0)) * linear / 1000
        out[f"{p}_gated_delta_mixer_ms_per_layer_microbatch"] = mixer_ms
        out[f"{p}_gated_delta_rule_ms_per_layer_microbatch"] = g["rule_ms"]
        out[f"{p}_gated_delta_share_of_step"] = per_step / ours["worker_step_median_s"]
        inverse = os.path.join(args.raw, f"{p}_gdn_inverse.json")
        if os.path.exists(inverse):  # the A/B: the chunk system's inverse for the triangular solves
            gi = json.load(open(inverse))
            out[f"{p}_gated_delta_mixer_ms_per_layer_microbatch_inverse"] = gi["mixer_without_projections_ms"]
            out[f"{p}_gated_delta_rule_ms_per_layer_microbatch_inverse"] = gi["rule_ms"]
        composed_conv = os.path.join(args.raw, f"{p}_gdn_composed_conv.json")
        if os.path.exists(composed_conv):  # the A/B: ATen's convolution (LORASTEP_FUSED_CONV=0)
            gc = json.load(open(composed_conv))
            out[f"{p}_gated_delta_mixer_ms_per_layer_microbatch_composed_conv"] = gc["mixer_without_projections_ms"]
        if kept_ms is not None:  # the rule keeping its intermediates (--keep_rule)
            out[f"{p}_gated_delta_mixer_ms_per_layer_microbatch_keep_rule"] = kept_ms
        out[f"{p}_gated_delta_method"] = (f"gated_delta_bench: the mixer without its projections per layer and micro-batch, "
                                          f"{mixer_ms:.2f} ms with the rule run again in backward ({recomputed} of the step's "
                                          f"micro-batches)" + (f" and {kept_ms:.2f} ms with its intermediates kept ({kept})" if kept else "")
                                          + f", x {linear} linear layers, over lorastep's step median")
    json.dump(out, open(os.path.join(args.raw, f"step_{p}.json"), "w"), indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
