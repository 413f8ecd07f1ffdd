#!/usr/bin/env bash
# The sampler on the GPU beside transformers `generate` + PEFT, side by side in one call, after
# scripts/bench.py's CMake build (the `sampler` suite runs it): per shape, lorastep's engine
# (bench/sampler_gpu_bench.cc) and then transformers (bench/hf_generate.py) on the same folder,
# prompts of PROMPT tokens, NEW new tokens, each batch size of BATCHES. Raw files in OUT_DIR,
# then bench/sampler_gpu_results.py writes OUT_DIR/sampler_gpu.json. Any failed row fails.
# HF_BATCHES (default BATCHES): the batch sizes transformers runs (its largest take minutes).
#   bench/sampler_gpu.sh BUILD_DIR OUT_DIR "0.5b 7b" BATCHES PROMPT NEW
set -euo pipefail
BIN=$1 OUT=$2 SHAPES=$3 BATCHES=$4 PROMPT=$5 NEW=$6
source "$(dirname "$0")/gen_model.sh"
for shape in $SHAPES; do
  case $shape in
    0.5b) MODEL=/tmp/q05; gen_model "$BIN/lorastep_genmodel" qwen2.5-0.5b bfloat16 $MODEL ;;
    7b) MODEL=/tmp/q7b_hf; python3 bench/make_hf_model.py --shape qwen2.5-7b --out $MODEL ;;
    *) echo "unknown shape $shape"; exit 1 ;;
  esac
  echo "== lorastep sampler, $shape"
  "$BIN/sampler_gpu_bench" "$MODEL" bfloat16 "$BATCHES" "$PROMPT" "$NEW" | tee "$OUT/sampler_ours_$shape.txt"
  echo "== transformers generate + PEFT, $shape"
  python3 bench/hf_generate.py --model "$MODEL" --batches "${HF_BATCHES:-$BATCHES}" --prompt "$PROMPT" --new "$NEW" \
    --out "$OUT/sampler_hf_$shape.json"
done
python3 bench/sampler_gpu_results.py "$OUT" "$SHAPES" "$PROMPT" "$NEW"
