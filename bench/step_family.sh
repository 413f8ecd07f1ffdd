#!/usr/bin/env bash
# A LoRA step of one model family against transformers + PEFT, side by side on the same random
# model (a lorastep_genmodel preset, bf16) and the same batch (bench/make_batch.py fixed: 64 x
# 512 tokens): lorastep (coordinator + worker, r32 on every projection; MoE experts per expert)
# and bench/peft_step.py (PEFT r32 on the same projections: its lora_targets). For a Qwen3.5
# preset also the Gated DeltaNet mixer's cost per micro-batch (bench/gated_delta_bench.cc); for
# gpt-oss also lorastep's step with its composed paths (LORASTEP_SINK_FLASH=0
# LORASTEP_FUSED_CLAMPED_SWIGLU=0: the explicit sink mask, ATen's clamped SwiGLU).
# Raw files in OUT_DIR, then step_family_results.py writes OUT_DIR/step_PREFIX.json.
#   bench/step_family.sh BUILD_DIR OUT_DIR PRESET PREFIX
set -euo pipefail
BIN=$1 OUT=$2 PRESET=$3 PREFIX=$4
MODEL=/tmp/family_$PREFIX
source "$(dirname "$0")/gen_model.sh"
gen_model "$BIN/lorastep_genmodel" "$PRESET" bfloat16 $MODEL
VOCAB=$(python3 -c "import json;print(json.load(open('$MODEL/config.json'))['vocab_size'])")
MT=${STEP_MAX_TOKENS:-8192}
python3 bench/make_batch.py --vocab "$VOCAB" --workload fixed --out "$OUT/batch_$PREFIX.json"
# lorastep's step into $OUT/${PREFIX}_ours_lora$1.json (the environment may switch paths).
ours_step() {
  MODEL_DIR=$MODEL RANK=32 MAX_TOKENS=$MT STEPS=${STEP_COUNT:-5} MODE=train BATCH_FILE="$OUT/batch_$PREFIX.json" \
    COORD_FLAGS="--max_tokens_per_microbatch $MT" MACHINE="$(head -1 "$OUT/env.txt")" VERSIONS="$(tail -1 "$OUT/env.txt")" \
    bench/service_overhead.sh "$BIN" "$PRESET" cuda bfloat16 "$OUT/${PREFIX}_ours_lora$1.json" overhead_fraction \
    > "$OUT/${PREFIX}_ours$1.log" 2>&1 || { echo "lorastep $PREFIX$1 failed"; tail -20 "$OUT/${PREFIX}_ours$1.log"; exit 1; }
}
ours_step ""
if python3 -c "import json,sys;sys.exit(0 if json.load(open('$MODEL/config.json'))['model_type'] == 'gpt_oss' else 1)"; then
  # Layers with sinks through the explicit mask and the experts' clamped SwiGLU as ATen's
  # composition: an A/B beside the default kernels above (lib/model/sink_attention.h,
  # lib/kernels/fused_layer.h).
  LORASTEP_SINK_FLASH=0 LORASTEP_FUSED_CLAMPED_SWIGLU=0 ours_step _composed_paths
fi
python3 bench/peft_step.py --model $MODEL --mode lora --steps "${HF_STEPS:-3}" --micro "${HF_MICRO:-8}" --batch "$OUT/batch_$PREFIX.json" \
  --out "$OUT/${PREFIX}_hf_lora.json" > "$OUT/${PREFIX}_hf.log" 2>&1 \
  || { echo "transformers + PEFT $PREFIX failed"; tail -20 "$OUT/${PREFIX}_hf.log"; exit 1; }
if python3 -c "import json,sys;sys.exit(0 if json.load(open('$MODEL/config.json')).get('layer_types') and 'linear_attention' in json.load(open('$MODEL/config.json'))['layer_types'] else 1)"; then
  read -r H KH VH HD < <(python3 -c "import json;c=json.load(open('$MODEL/config.json'));print(c['hidden_size'],c['linear_num_key_heads'],c['linear_num_value_heads'],c['linear_key_head_dim'])")
  # The mixer's cost into $OUT/${PREFIX}_gdn$1.json; $2: what the environment or flags change
  # (recorded as the command), then any further flags.
  gdn_bench() {
    local suffix=$1 what=$2
    shift 2
    "$BIN/gated_delta_bench" --device cuda --seqs $((MT / 512)) --len 512 --hidden "$H" --key_heads "$KH" \
      --value_heads "$VH" --head_dim "$HD" --machine "$(head -1 "$OUT/env.txt")" "$@" \
      --command "bench/step_family.sh (${what:+$what }gated_delta_bench --seqs $((MT / 512)) --len 512${*:+ $*})" \
      --out "$OUT/${PREFIX}_gdn$suffix.json" > /dev/null
  }
  gdn_bench "" ""
  # The same with the chunk system's inverse in place of the triangular solves (an A/B).
  LORASTEP_GDN_TRIANGULAR_SOLVE=0 gdn_bench _inverse LORASTEP_GDN_TRIANGULAR_SOLVE=0
  # And with ATen's convolution in place of the CUDA kernel (lib/kernels/causal_conv.h).
  LORASTEP_FUSED_CONV=0 gdn_bench _composed_conv LORASTEP_FUSED_CONV=0
  # And with the rule keeping its intermediates instead of running again in backward.
  gdn_bench _keep_rule "" --keep_rule
fi
if [ -n "${STEP_FAMILY_PROFILE:-}" ]; then  # a Kineto profile of lorastep's second step, summarized
  LORASTEP_PROFILE_TRACE=/tmp/${PREFIX}_trace.json LORASTEP_PROFILE_STEP=2 MODEL_DIR=$MODEL RANK=32 MAX_TOKENS=$MT STEPS=2 \
    COORD_FLAGS="--max_tokens_per_microbatch $MT" BATCH_FILE="$OUT/batch_$PREFIX.json" \
    bench/service_overhead.sh "$BIN" "$PRESET" cuda bfloat16 /tmp/${PREFIX}_profiled.json x > /tmp/${PREFIX}_profiled.log 2>&1 \
    || { echo "the profiled $PREFIX step failed"; tail -5 /tmp/${PREFIX}_profiled.log; exit 1; }
  python3 bench/profile_summary.py /tmp/${PREFIX}_trace.json --label "lorastep $PRESET LoRA step, 64 x 512, micro-batch $MT" \
    --machine "$(head -1 "$OUT/env.txt")" --command "STEP_FAMILY_PROFILE=1 bench/step_family.sh" --out "$OUT/profile_$PREFIX.json"
fi
python3 bench/step_family_results.py "$OUT" "$MODEL" "$PRESET" "$PREFIX" --micro_batch "$MT"
