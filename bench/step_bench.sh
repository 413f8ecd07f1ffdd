#!/usr/bin/env bash
# Issue 9's side-by-side step benchmark on the H200, after scripts/bench.py's CMake
# build (GPU_CHECK_STEPS=step runs it): one random Qwen2.5-0.5B-shaped model and the same
# batch files (bench/make_batch.py: 64 x 512 and 64 of 128-1024 tokens) for both sides.
#   lorastep (coordinator + worker): LoRA r32 on all linears, full fine-tuning, Forward
#   transformers (+ PEFT): the same three, bench/peft_step.py
# plus the bf16 GEMM peak, and a Kineto profile of one LoRA step (separate run, so the
# profiler does not perturb the timed ones). Raw files in OUT_DIR, then step_results.py.
# Any failed row fails the script.
#   bench/step_bench.sh BUILD_DIR OUT_DIR
set -euo pipefail
BIN=$1 OUT=$2
MODEL=/tmp/q05
source "$(dirname "$0")/gen_model.sh"
gen_model "$BIN/lorastep_genmodel" qwen2.5-0.5b bfloat16 $MODEL
VOCAB=$(python3 -c "import json;print(json.load(open('$MODEL/config.json'))['vocab_size'])")
MT=${STEP_MAX_TOKENS:-8192}  # lorastep's micro-batch (padded tokens): the worker default
python3 bench/gemm_peak.py --out "$OUT/gemm_peak.json"
for w in fixed varlen; do python3 bench/make_batch.py --vocab "$VOCAB" --workload $w --out "$OUT/batch_$w.json"; done
run_ours() {  # mode workload rank [micro-batch: an extra row, file ours_MODE_W_mbN.json]
  local mode=$1 w=$2 rank=$3 mt=${4:-$MT} m=train name="ours_${1}_$2"
  [ -n "${4:-}" ] && name="${name}_mb$4"
  name="$name${NAME_SUFFIX:-}"
  [ "$mode" = logprobs ] && m=forward
  MODEL_DIR=$MODEL RANK=$rank MAX_TOKENS=$mt STEPS=${STEP_COUNT:-5} MODE=$m BATCH_FILE="$OUT/batch_$w.json" \
    COORD_FLAGS="--max_tokens_per_microbatch $mt" MACHINE="$(head -1 "$OUT/env.txt")" VERSIONS="$(tail -1 "$OUT/env.txt")" \
    bench/service_overhead.sh "$BIN" qwen2.5-0.5b cuda bfloat16 "$OUT/$name.json" overhead_fraction \
    > "/tmp/$name.log" 2>&1 || { echo "lorastep $name failed"; tail -20 "/tmp/$name.log"; exit 1; }
  python3 -c "import json,sys;d=json.load(open(sys.argv[1]));m=d['last_step_metrics'];print('lorastep',sys.argv[2],round(d['worker_step_median_s'],4),'s',{k:round(v,4) for k,v in m.items() if k.startswith('time_') or k.startswith('peak_cuda')})" \
    "$OUT/$name.json" "$name mb=$mt"
}
for spec in ${STEP_OURS:-lora:fixed:32 full:fixed:0 logprobs:fixed:32 lora:varlen:32 full:varlen:0}; do
  IFS=: read -r mode w rank mt <<< "$spec"; run_ours "$mode" "$w" "$rank" "$mt"
done
# A/B rows in the same call: STEP_UNFUSED (lorastep's fused layer kernels off, files
# *_unfused.json) and STEP_NOFOLD (LoRA B addmms instead of the K-concatenated gate/up GEMM,
# files *_nofold.json), each a list of specs like STEP_OURS.
for spec in ${STEP_UNFUSED:-}; do
  IFS=: read -r mode w rank mt <<< "$spec"
  LORASTEP_FUSED_KERNELS=0 NAME_SUFFIX=_unfused run_ours "$mode" "$w" "$rank" "$mt"
done
for spec in ${STEP_NOFOLD:-}; do
  IFS=: read -r mode w rank mt <<< "$spec"
  LORASTEP_FOLD_LORA_B=0 NAME_SUFFIX=_nofold run_ours "$mode" "$w" "$rank" "$mt"
done
# STEP_IN_PROCESS: rows with the worker in the coordinator's process
# (lorastep_coordinator_with_worker --in_process_worker; build that target too), files
# *_inproc.json. IN_PROCESS_WORKER=true in the environment runs every row that way.
for spec in ${STEP_IN_PROCESS:-}; do
  IFS=: read -r mode w rank mt <<< "$spec"
  IN_PROCESS_WORKER=true NAME_SUFFIX=_inproc run_ours "$mode" "$w" "$rank" "$mt"
done
for spec in ${STEP_HF:-lora:fixed full:fixed logprobs:fixed lora:varlen}; do
  IFS=: read -r mode w <<< "$spec"
  python3 bench/peft_step.py --model $MODEL --mode "$mode" --batch "$OUT/batch_$w.json" --out "$OUT/hf_${mode}_$w.json" 2>&1 | tail -1 | cut -c1-300
done
# STEP_PROFILE: the modes to profile, "lora" by default (also "full"); STEP_NO_PROFILE: none.
[ -n "${STEP_NO_PROFILE:-}" ] && STEP_PROFILE=" "
for mode in ${STEP_PROFILE:-lora}; do
  rank=32; [ "$mode" = full ] && rank=0
  LORASTEP_PROFILE_TRACE=/tmp/${mode}_trace.json LORASTEP_PROFILE_STEP=2 MODEL_DIR=$MODEL RANK=$rank MAX_TOKENS=$MT STEPS=2 \
    BATCH_FILE="$OUT/batch_fixed.json" bench/service_overhead.sh "$BIN" qwen2.5-0.5b cuda bfloat16 /tmp/profiled.json x > /tmp/profiled.log 2>&1 \
    || { echo "the profiled $mode step failed"; tail -5 /tmp/profiled.log; exit 1; }
  python3 bench/profile_summary.py /tmp/${mode}_trace.json --label "lorastep $mode (rank $rank) train step, 64 x 512, micro-batch $MT" \
    --machine "$(head -1 "$OUT/env.txt") / $(tail -1 "$OUT/env.txt")" \
    --command "LORASTEP_PROFILE_TRACE=... LORASTEP_PROFILE_STEP=2 bench/service_overhead.sh (bench/step_bench.sh, micro-batch $MT)" \
    --out "$OUT/profile_${mode}_step.json"
done
python3 bench/step_results.py "$OUT" $MODEL "$OUT/step.json" --micro_batch "$MT" ${CPU_RESULT:+--cpu "$CPU_RESULT"}
