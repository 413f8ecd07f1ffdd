#!/usr/bin/env bash
# On the H200 machine (device tool): build with CMake against torch 2.11 + the carried
# Debian sysroot (.sysroot: absl, nlohmann-json, gtest, OpenSSL; scripts/make_sysroot.sh),
# run the tests on CUDA, the dgrad microbenchmark, and the HF/PEFT parity checks.
# Results land in $OUT (or ./out). BUILD_TARGETS limits the build (e.g. to what a step needs).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SYSROOT=$PWD/.sysroot
TORCH_DIR=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export LIBRARY_PATH=$SYSROOT/usr/lib/x86_64-linux-gnu:$SYSROOT/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$SYSROOT/usr/lib/x86_64-linux-gnu:$SYSROOT/lib/x86_64-linux-gnu:$TORCH_DIR/lib:${LD_LIBRARY_PATH:-}
export PATH=$SYSROOT/usr/bin:$PATH  # protoc, grpc_cpp_plugin
export TORCH_CUDA_ARCH_LIST=9.0
MACHINE=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
{
  echo "machine: $MACHINE"; python3 -c 'import torch,transformers,peft;print("torch",torch.__version__,"cuda",torch.version.cuda,"transformers",transformers.__version__,"peft",peft.__version__)'
} | tee "$OUT/env.txt"
step() { echo "=== $*"; }
NCCL_DIR=$(python3 -c 'import nvidia.nccl as n;print(list(n.__path__)[0])')
export LD_LIBRARY_PATH=$NCCL_DIR/lib:$LD_LIBRARY_PATH
GPUS=$(nvidia-smi -L | wc -l)
step configure
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE;$SYSROOT/usr" -DOPENSSL_ROOT_DIR="$SYSROOT/usr" \
  -DProtobuf_ROOT="$SYSROOT/usr" -DLORASTEP_WITH_NCCL=ON -DLORASTEP_NCCL_INCLUDE="$NCCL_DIR/include" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" > "$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; exit 1; }
grep -q "LORASTEP_WITH_CUDA_KERNELS\|token_scores_kernel" build-gpu/build.ninja && echo "lorastep CUDA kernels: on ($(command -v nvcc || echo /usr/local/cuda/bin/nvcc))" || echo "lorastep CUDA kernels: off (no nvcc)"
step build
ninja -C build-gpu -j"$(nproc)" -k 0 ${BUILD_TARGETS:-} > "$OUT/build.log" 2>&1 || { grep -E "error:" "$OUT/build.log" | sort -u | head -40; exit 1; }
STEPS=${GPU_CHECK_STEPS:-tests bench parity service}
[[ " $STEPS " == *" build-only "* ]] && exit 0
if [[ " $STEPS " == *" debug "* ]]; then
  step "trainer_test under cuda-gdb"
  cuda-gdb -batch -ex 'set print thread-events off' -ex run -ex 'x/8ga $sp' \
    -ex 'info symbol *(long*)$sp' -ex 'info threads' --args build-gpu/trainer_test --gtest_filter="${GTEST_FILTER:-*}" 2>&1 | grep -vE "^\[New Thread|^\[Thread" | tail -60
fi
if [[ " $STEPS " == *" tests "* ]]; then
step "tests on cuda"
for dt in ${GPU_TEST_DTYPES:-float32 bfloat16}; do
  (cd build-gpu && LORASTEP_TEST_DEVICE=cuda LORASTEP_TEST_GPUS=$GPUS LORASTEP_TEST_DTYPE=$dt \
    ctest --output-on-failure ${CTEST_ARGS:-}) > "$OUT/ctest_cuda_$dt.log" 2>&1
  echo "cuda $dt:"; grep -E "tests passed|Passed|Failed|\*\*\*" "$OUT/ctest_cuda_$dt.log"
done
fi
if [[ " $STEPS " == *" bench "* ]]; then
step "dgrad bench"
build-gpu/dgrad_bench --device cuda --out "$OUT/dgrad.json" --machine "$MACHINE" \
  --command "scripts/gpu_check.sh (build-gpu/dgrad_bench --device cuda)" | grep -E "_ms|over|err"
fi
if [[ " $STEPS " == *" parity "* ]]; then
step "parity"
build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 
for dt in ${GPU_TEST_DTYPES:-float32 bfloat16}; do
  tol=1e-3; [ "$dt" = bfloat16 ] && tol=3e-2
  PYTHONUNBUFFERED=1 python3 bench/hf_parity.py --model /tmp/q05 --parity-bin build-gpu/lorastep_parity \
    --device cuda --dtype $dt --tolerance $tol --workdir /tmp/par_$dt --out "$OUT/hf_parity_$dt.json" 2>&1 | tail -22
done
fi
if [[ " $STEPS " == *" parity-head "* ]]; then
  step "parity with LoRA on the LM head too (train_unembed) against PEFT"
  [ -d /tmp/q05 ] || build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 >/dev/null
  for dt in float32 bfloat16; do
    tol=1e-3; [ "$dt" = bfloat16 ] && tol=3e-2
    PYTHONUNBUFFERED=1 python3 bench/hf_parity.py --model /tmp/q05 --parity-bin build-gpu/lorastep_parity \
      --device cuda --dtype $dt --tolerance $tol \
      --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head \
      --workdir /tmp/par_head_$dt --out "$OUT/hf_parity_head_$dt.json" 2>&1 | \
      grep -E '"(logits_rel_err|lora_grad_rel_err|lora_grad_worst_tensor_rel_err|lora_tensors_compared|peft_dtype_vs_peft_fp32_grad_rel_err|pass)"|Error|error' | tr -d '\n'; echo " <- head $dt"
  done
fi
if [[ " $STEPS " == *" moe "* ]]; then
  step "MoE parity against transformers (tiny Qwen2-MoE and Qwen3-MoE; attention LoRA vs PEFT)"
  for preset in tiny-moe tiny-qwen3-moe; do
    build-gpu/lorastep_genmodel --preset $preset --seed 2 --out /tmp/$preset > /dev/null
    for dt in float32 bfloat16; do
      tol=1e-3; [ "$dt" = bfloat16 ] && tol=3e-2
      PYTHONUNBUFFERED=1 python3 bench/hf_parity.py --model /tmp/$preset --parity-bin build-gpu/lorastep_parity \
        --device cuda --dtype $dt --tolerance $tol --targets q_proj,k_proj,v_proj,o_proj --seq 64 \
        --workdir /tmp/moe_${preset}_$dt --out "$OUT/moe_parity_${preset}_$dt.json" 2>&1 | \
        grep -E '"(hf_class|logits_rel_err|lora_grad_rel_err|hf_dtype_vs_hf_fp32_logits_rel_err|pass)"|Error|error' | tr -d '\n'; echo " <- $preset $dt"
    done
  done
fi
if [[ " $STEPS " == *" moe-bench "* ]]; then
  step "MoE benchmark: reduced Qwen3-30B-A3B (4 layers, 128 experts, top-8), bf16, 64 x 512"
  [ -d /tmp/q3moe ] || build-gpu/lorastep_genmodel --preset qwen3-30b-a3b-reduced --dtype bfloat16 --seed 1 --out /tmp/q3moe >/dev/null
  python3 bench/peft_step.py --model /tmp/q3moe --mode fwdbwd --out "$OUT/moe_hf_fwdbwd.json" 2>&1 | tail -1
  for layout in ${MOE_LAYOUTS:-shared_outer per_expert}; do
    for mt in ${MOE_MAX_TOKENS:-4096}; do
      MODEL_DIR=/tmp/q3moe RANK=32 EXPERT_LORA=$layout MAX_TOKENS=$mt STEPS=3 MACHINE="$MACHINE" VERSIONS="$(tail -1 "$OUT/env.txt")" \
        bench/service_overhead.sh build-gpu qwen3-30b-a3b-reduced cuda bfloat16 "$OUT/moe_ours_${layout}_$mt.json" \
        moe_$layout > /tmp/moe_ours_$layout.log 2>&1 || tail -20 /tmp/moe_ours_$layout.log
      python3 -c "import json,sys;d=json.load(open(sys.argv[1]));m=d['last_step_metrics'];print('lorastep',sys.argv[2],'micro-batch',sys.argv[3],'worker_step_s',d['worker_step_s'],{k:round(v,4) for k,v in m.items() if k.startswith('time_')})" \
        "$OUT/moe_ours_${layout}_$mt.json" $layout $mt
    done
  done
fi
if [[ " $STEPS " == *" attention "* ]]; then
  step "attention: repeated K/V + SDPA vs SDPA enable_gqa vs packed flash varlen (0.5B shape, bf16)"
  python3 bench/attention_bench.py --out "$OUT/attention.json" | grep -E "_ms|error"
fi
if [[ " $STEPS " == *" step "* ]]; then
  step "step benchmark: lorastep vs transformers + PEFT (0.5B shape, bf16; fixed and variable length)"
  bash bench/step_bench.sh build-gpu "$OUT"
fi
if [[ " $STEPS " == *" step7b "* ]]; then
  step "LoRA step on a 7B-class model transformers writes (Qwen2.5-7B shape): lorastep vs transformers + PEFT"
  bash bench/step7b.sh build-gpu "$OUT"
fi
if [[ " $STEPS " == *" long "* ]]; then  # issue 29: 32k-131k-token sequences on one GPU, recomputation's cost
  step "long context: 7B shape (YaRN 131,072) on 1 x 32,768 and 1 x 131,072, 0.5B on 1 x 131,072, recompute at 2 x 16,384"
  bash bench/long_context.sh build-gpu "$OUT" ${LONG_RUNS:-}
fi
if [[ " $STEPS " == *" families "* ]]; then  # every family and RoPE variant against transformers + PEFT
  step "families: qwen2, qwen3, llama (tied, untied), qwen3_moe, qwen2 with linear/dynamic/yarn RoPE"
  PYTHONUNBUFFERED=1 python3 bench/families.py --parity-bin build-gpu/lorastep_parity --out "$OUT/families.json" \
    ${FAMILIES_ONLY:+--only $FAMILIES_ONLY} 2>&1 | tail -20
fi
if [[ " $STEPS " == *" digest "* ]]; then  # after "step" in the same call: the check's share of its LoRA step
  step "digest check of a TP2 rank's replicated LoRA gradients (0.5B shape, r32) beside the single-GPU LoRA step"
  [ -d /tmp/q05 ] || build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 >/dev/null
  build-gpu/digest_cost --model_dir /tmp/q05 --lora_rank 32 --tp 2 --out "$OUT/digest_tp2.json" --machine "$MACHINE" \
    --command "GPU_CHECK_STEPS='step digest' bash scripts/gpu_check.sh (device tool)" > /dev/null
  python3 bench/digest_results.py "$OUT/digest_tp2.json" "$OUT/ours_lora_fixed.json" "$OUT/env.txt" "$OUT/digest_cost.json"
fi
if [[ " $STEPS " == *" multi-gpu "* ]]; then
  step "multi-GPU on NCCL ($GPUS GPUs): DP2, TP2, PP2, EP2 against world 1, DP2 speedup, killed worker"
  MACHINE="$MACHINE, $GPUS GPUs, $(nproc) cores" \
    VERSIONS="$(tail -1 "$OUT/env.txt") nccl $(python3 -c 'import torch;print(".".join(map(str,torch.cuda.nccl.version())))')" \
    MULTI_COMMAND="GPU_CHECK_STEPS=multi-gpu bash scripts/gpu_check.sh (device tool, nvidia-h200-x2)" \
    bash bench/multi_gpu.sh build-gpu "$OUT"
fi
if [[ " $STEPS " == *" service "* ]]; then
  step "service overhead (qwen2.5-0.5b bf16, 64 x 512 tokens)"
  MACHINE="$MACHINE" VERSIONS="$(tail -1 "$OUT/env.txt")" \
    bench/service_overhead.sh build-gpu qwen2.5-0.5b cuda bfloat16 "$OUT/service_overhead_gpu.json" \
    overhead_fraction_gpu | grep -E "overhead_fraction_gpu|client_step|worker_step" -A6 | head -24
fi
if [[ " $STEPS " == *" service-split "* ]]; then  # where the service overhead goes, per side
  step "service overhead split: client, coordinator, worker (--v=2 call durations)"
  [ -d /tmp/q05 ] || build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 >/dev/null
  python3 bench/make_batch.py --vocab 151936 --workload fixed --out "$OUT/batch_fixed.json"
  # SPLIT_PACKED: the client's datums forms to run, in order (e.g. "true false true false");
  # SPLIT_WORKER: the worker kinds, alternated outside them ("process in_process ..."); a
  # kind may carry extra coordinator flags after a colon, comma-separated, then client flags
  # after a '+' ("in_process:--executor_spin_us=2000+--tune_malloc").
  n=0
  for variant in ${SPLIT_WORKER:-process}; do
  worker=${variant%%:*}
  extra=$([[ "$variant" == *:* ]] && echo "${variant#*:}" | cut -d+ -f1 | tr ',' ' ' || true)
  client_extra=$([[ "$variant" == *+* ]] && echo "${variant#*+}" | tr ',' ' ' || true)
  for packed in ${SPLIT_PACKED:-true}; do
  n=$((n + 1))
  for m in forward train; do
    f="split_${m}_packed${packed}_${worker}_$n"
    echo "variant $n: $worker packed=$packed extra coordinator flags: ${extra:-none}; client flags: ${client_extra:-none}"
    IN_PROCESS_WORKER=$([ "$worker" = in_process ] && echo true || echo false) \
    MODEL_DIR=/tmp/q05 RANK=32 STEPS=${SPLIT_STEPS:-6} MODE=$m PACKED=$packed BATCH_FILE="$OUT/batch_fixed.json" SERVER_LOG="$OUT/server_$f.log" \
      MACHINE="$MACHINE" VERSIONS="$(tail -1 "$OUT/env.txt")" \
      COORD_FLAGS="--max_tokens_per_microbatch 8192 --v=2 $extra" CLIENT_FLAGS="$client_extra" \
      bench/service_overhead.sh build-gpu qwen2.5-0.5b cuda bfloat16 "$OUT/$f.json" overhead_fraction > /dev/null 2> "$OUT/client_$f.log"
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[1],'overhead',round(d['overhead_fraction'],4),'client-worker ms',[round((a-b)*1e3,2) for a,b in zip(d['client_step_s'],d['worker_step_s'])],'minor faults client',d.get('client_minor_faults'),'server',d.get('server_minor_faults'))" "$OUT/$f.json"
    grep -o "component=[a-z]*.*method=[A-Za-z/]*.*duration_ms=[0-9.]*" "$OUT/server_$f.log" | grep -E "Forward|TrainStep" | sed 's/ code=OK//' | tail -4
  done
  done
  done
fi
if [[ " $STEPS " == *" autosave "* ]]; then  # autosave cost on the step: none / sync / background
  step "autosave cost: no journal, autosave on the step's path, background autosave (0.5B, rank 32)"
  [ -d /tmp/q05 ] || build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 >/dev/null
  python3 bench/make_batch.py --vocab 151936 --workload fixed --out "$OUT/batch_fixed.json"
  for kind in ${AUTOSAVE_WORKERS:-process in_process}; do  # the worker as a process / in the coordinator
    IN_PROCESS_WORKER=$([ "$kind" = in_process ] && echo true || echo false) MODEL_DIR=/tmp/q05 RANK=32 \
      BATCH_FILE="$OUT/batch_fixed.json" MACHINE="$MACHINE" VERSIONS="$(tail -1 "$OUT/env.txt")" \
      STEPS=${AUTOSAVE_STEPS:-8} ROUNDS=${AUTOSAVE_ROUNDS:-2} COORD_FLAGS="--max_tokens_per_microbatch 8192" \
      bench/autosave_cost.sh build-gpu qwen2.5-0.5b cuda bfloat16 "$OUT/autosave_$kind"
    python3 bench/autosave_results.py "$OUT/autosave_$kind" "$OUT/autosave_$kind.json" \
      --worker $kind --command "AUTOSAVE_WORKERS=$kind GPU_CHECK_STEPS=autosave bash scripts/gpu_check.sh"
  done
fi
if [[ " $STEPS " == *" hop "* ]]; then  # one gRPC hop without training (bench/hop_cost)
  step "hop cost: HOP_ARGS variants, ';'-separated"
  IFS=';' read -ra hop_variants <<< "${HOP_ARGS:---timeline --calls 30 --step_ms 220}"
  for v in "${hop_variants[@]}"; do build-gpu/hop_cost $v 2>&1 | tail -1; done | tee "$OUT/hop.txt"
fi
if [[ " $STEPS " == *" peer "* ]]; then
  step "side by side: transformers + PEFT vs lorastep (0.5B shape, bf16, 64 x 512, micro-batch 8)"
  [ -d /tmp/q05 ] || build-gpu/lorastep_genmodel --preset qwen2.5-0.5b --dtype bfloat16 --seed 1 --out /tmp/q05 >/dev/null
  for mode in lora full; do
    python3 bench/peft_step.py --model /tmp/q05 --mode $mode --out "$OUT/peer_$mode.json" 2>&1 | tail -1
  done
  for rank in 32 0; do
    RANK=$rank MAX_TOKENS=4096 STEPS=3 MACHINE="$MACHINE" bench/service_overhead.sh build-gpu \
      qwen2.5-0.5b cuda bfloat16 "$OUT/ours_rank$rank.json" overhead_fraction_gpu > /dev/null
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print('lorastep rank',sys.argv[2],d['worker_step_s'])" "$OUT/ours_rank$rank.json" $rank
  done
fi
