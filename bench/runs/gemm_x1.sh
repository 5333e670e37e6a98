#!/usr/bin/env bash
# Decode GEMMs on one H200: bench.gemm's sweep of kernels.linear against cuBLAS, then
# bench.engine (gpt2 fp16, batch 1 and 256) with kernels.linear and without, same machine.
# Usage: bash bench/runs/gemm_x1.sh OUT_DIR [SWEEP_BUDGET_S]   (~6-9 min)
set -u
out=${1:-results}
budget=${2:-240}
mkdir -p "$out"
timeout $((budget + 60)) python -m bench.gemm --budget-s "$budget" --out "$out/gemm.json" 2>&1 \
  | grep -v -i warning
for flag in "" --no-triton-linear; do
  echo "== bench.engine gpt2 fp16 ${flag:-(kernels.linear)}"
  timeout 200 python -m bench.engine --model gpt2 --dtype float16 --batch 1 256 $flag \
    ${HF:+--hf} --out "$out/engine_gpt2${flag:+_cublas}.json" 2>&1 | grep -v -i warning | tail -8
done
