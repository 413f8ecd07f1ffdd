#!/usr/bin/env bash
# The LoRA step on a 7B-class model that transformers itself writes (issue 28): Qwen2.5-7B's
# shape, random bf16 weights in its own shards; lorastep (coordinator + worker, LoRA r32 on all
# linears, micro-batch 8192 tokens) against transformers + PEFT on the same 64 x 512 batch, in
# one call, beside the measured bf16 GEMM peak. Raw files in OUT_DIR; bench/step7b_results.py
# adds the lora_7b_* keys to OUT_DIR/step_7b.json.
#   bench/step7b.sh BUILD_DIR OUT_DIR
set -euo pipefail
BIN=$1 OUT=$2
MODEL=/tmp/q7b_hf
python3 bench/make_hf_model.py --shape qwen2.5-7b --out $MODEL
VOCAB=$(python3 -c "import json;print(json.load(open('$MODEL/config.json'))['vocab_size'])")
[ -f "$OUT/gemm_peak.json" ] || python3 bench/gemm_peak.py --out "$OUT/gemm_peak.json"
python3 bench/make_batch.py --vocab "$VOCAB" --workload fixed --out "$OUT/batch_fixed_7b.json"
# STEP7B_MBS: lorastep's micro-batch sizes (padded tokens), one row each; the first is the
# headline row (ours_lora_7b.json), the others ours_lora_7b_mbN.json.
first=1
for mb in ${STEP7B_MBS:-8192}; do
  name=ours_lora_7b; [ $first = 1 ] || name=ours_lora_7b_mb$mb
  MODEL_DIR=$MODEL RANK=32 MAX_TOKENS=$mb STEPS=${STEP_COUNT:-5} MODE=train BATCH_FILE="$OUT/batch_fixed_7b.json" \
    COORD_FLAGS="--max_tokens_per_microbatch $mb" MACHINE="$(head -1 "$OUT/env.txt")" VERSIONS="$(tail -1 "$OUT/env.txt")" \
    bench/service_overhead.sh "$BIN" qwen2.5-0.5b cuda bfloat16 "$OUT/$name.json" overhead_fraction \
    > /tmp/$name.log 2>&1 || { echo "lorastep 7b (micro-batch $mb) failed"; tail -20 /tmp/$name.log; exit 1; }
  first=0
done
# STEP7B_PROFILE=1: also a Kineto profile of one lorastep step at the first micro-batch size
# (a separate run, so the profiler does not perturb the timed ones): profile_lora_7b_step.json.
if [ -n "${STEP7B_PROFILE:-}" ]; then
  mb=$(set -- ${STEP7B_MBS:-8192}; echo $1)
  LORASTEP_PROFILE_TRACE=/tmp/lora_7b_trace.json LORASTEP_PROFILE_STEP=2 MODEL_DIR=$MODEL RANK=32 MAX_TOKENS=$mb STEPS=2 \
    MODE=train BATCH_FILE="$OUT/batch_fixed_7b.json" COORD_FLAGS="--max_tokens_per_microbatch $mb" \
    bench/service_overhead.sh "$BIN" qwen2.5-0.5b cuda bfloat16 /tmp/profiled_7b.json x > /tmp/profiled_7b.log 2>&1 \
    || { echo "the profiled 7b step failed"; tail -5 /tmp/profiled_7b.log; exit 1; }
  python3 bench/profile_summary.py /tmp/lora_7b_trace.json --label "lorastep LoRA r32 train step, Qwen2.5-7B shape, 64 x 512, micro-batch $mb" \
    --machine "$(head -1 "$OUT/env.txt")" --command "${BENCH_COMMAND:-python3 scripts/bench.py --profile suite step7b}" \
    --out "$OUT/profile_lora_7b_step.json" | tail -3
fi
python3 bench/peft_step.py --model $MODEL --mode lora --batch "$OUT/batch_fixed_7b.json" --out "$OUT/hf_lora_7b.json" \
  2>&1 | tail -1 | cut -c1-300
python3 bench/step7b_results.py "$OUT" "$MODEL" "$OUT/step_7b.json"
