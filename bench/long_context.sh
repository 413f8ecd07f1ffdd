#!/usr/bin/env bash
# Long sequences on one GPU (issue 29): LoRA r32 train steps on models transformers writes
# with Qwen2.5's long-context config (YaRN factor 4 over 32,768 -> 131,072 positions).
#   q7b_32768, q7b_131072: the Qwen2.5-7B shape on 1 x 32,768 and 1 x 131,072 tokens
#   q05_131072:            the Qwen2.5-0.5B shape on 1 x 131,072 tokens
#   recompute_none/selective/full: the 7B shape on 2 x 16,384 tokens without and with every
#                          layer recomputed (the warm-up step as ForwardBackward + OptimStep,
#                          so all record the same first step's loss, grad_norm and log-probs)
# The worker picks recomputation itself (--activation_recompute auto) in the q* runs. Raw
# files (and the models' configs) in OUT_DIR; bench/long_context_results.py writes
# OUT_DIR/long_context.json from them. RUN names some of the runs (default: all five), for
# splitting them over calls; the results script then reads the raw files of all of them.
# A failed run is reported and the others go on; the script then fails.
#   bench/long_context.sh BUILD_DIR OUT_DIR [RUN ...]
set -euo pipefail
BIN=$1 OUT=$2; shift 2
RUNS=" ${*:-q7b_32768 recompute q05_131072 q7b_131072} "
Q7=/tmp/q7b_yarn Q05=/tmp/q05_yarn
python3 bench/make_hf_model.py --shape qwen2.5-7b-yarn --out $Q7
python3 bench/make_hf_model.py --shape qwen2.5-0.5b-yarn --out $Q05
cp $Q7/config.json "$OUT/config_q7b.json"; cp $Q05/config.json "$OUT/config_q05.json"
vocab() { python3 -c "import json,sys;print(json.load(open(sys.argv[1]+'/config.json'))['vocab_size'])" "$1"; }
[ -f "$OUT/gemm_peak.json" ] || python3 bench/gemm_peak.py --out "$OUT/gemm_peak.json"
batch() {  # batch MODEL SEQUENCES LENGTH NAME
  python3 bench/make_batch.py --vocab "$(vocab "$1")" --workload fixed --sequences "$2" --length "$3" \
    --out "$OUT/batch_$4.json" > /dev/null
}
train() {  # train NAME MODEL BATCH MICRO_BATCH STEPS [extra coordinator flags] ; CLIENT_FLAGS from the caller
  local name=$1 model=$2 b=$3 mb=$4 steps=$5; shift 5
  MODEL_DIR=$model RANK=32 MAX_TOKENS=$mb STEPS=$steps MODE=train BATCH_FILE="$OUT/batch_$b.json" \
    COORD_FLAGS="--max_tokens_per_microbatch $mb $*" MACHINE="$(head -1 "$OUT/env.txt")" VERSIONS="$(tail -1 "$OUT/env.txt")" \
    bench/service_overhead.sh "$BIN" "$name" cuda bfloat16 "$OUT/$name.json" overhead_fraction \
    > "/tmp/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "/tmp/$name.log"; FAILED="$FAILED $name"; }
}
FAILED=
batch $Q7 1 32768 q7b_32768
batch $Q7 2 16384 q7b_2x16384
batch $Q7 1 131072 q7b_131072
batch $Q05 1 131072 q05_131072
if [[ $RUNS == *" q7b_32768 "* ]]; then train q7b_32768 $Q7 q7b_32768 32768 3; fi
if [[ $RUNS == *" recompute "* ]]; then
  CLIENT_FLAGS=--first_step_logprobs train recompute_none $Q7 q7b_2x16384 16384 3 --activation_recompute none
  CLIENT_FLAGS=--first_step_logprobs train recompute_selective $Q7 q7b_2x16384 16384 3 --activation_recompute selective
  CLIENT_FLAGS=--first_step_logprobs train recompute_full $Q7 q7b_2x16384 16384 3 --activation_recompute full
fi
if [[ $RUNS == *" q05_131072 "* ]]; then train q05_131072 $Q05 q05_131072 131072 2; fi
if [[ $RUNS == *" q7b_131072 "* ]]; then train q7b_131072 $Q7 q7b_131072 131072 2; fi
python3 bench/long_context_results.py "$OUT" "$OUT/long_context.json"
[ -z "$FAILED" ] || { echo "failed:$FAILED"; exit 1; }
