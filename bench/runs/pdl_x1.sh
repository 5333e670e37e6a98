#!/usr/bin/env bash
# The decode step's launch overlap (kernels.pdl) and kernels.linear on one H200, each on
# and off, same machine. Parts (PARTS, default "tests engine"):
#   tests    the gpu tests of the engine and of the kernels they touch
#   engine   bench.engine gpt2 fp16, batch 1 and 256, four configurations; the first row
#            also measures Hugging Face and the ITL run (REPEAT=2 runs the four twice)
#   profile  bench.profile_step gpt2 fp16 batch 256: graph replay time and kernels, four
#            configurations
#   qwen3    bench.engine qwen3-0.6b bf16, PDL on (with HF and ITL) and off
# Usage: PARTS="engine profile" bash bench/runs/pdl_x1.sh OUT_DIR   (~1 min per run)
set -u
out=${1:-results}
mkdir -p "$out"
configs=("" "--no-pdl" "--no-triton-linear" "--no-pdl --no-triton-linear")
names=(pdl_triton nopdl_triton pdl_cublas nopdl_cublas)
engine() {  # model, dtype, name, extra bench.engine args
  local model=$1 dtype=$2 name=$3
  shift 3
  echo "== bench.engine $model $name $*"
  timeout 240 python -m bench.engine --model "$model" --dtype "$dtype" --batch 1 256 "$@" \
    --out "$out/engine_${model}_$name.json" 2>&1 | grep -v -i warning | tail -9
}
for part in ${PARTS:-tests engine}; do
  case $part in
  tests)
    timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/replica \
      tests/kernels/test_linear.py tests/kernels/test_decode_attention.py 2>&1 | tail -3 ;;
  engine)
    for rep in $(seq "${REPEAT:-1}"); do
      for i in "${!configs[@]}"; do
        extra=()
        [ "$i" = 0 ] && [ "$rep" = 1 ] && extra=(--hf --itl-batch 64)
        # shellcheck disable=SC2086
        engine gpt2 float16 "${names[$i]}_r$rep" ${configs[$i]} "${extra[@]}"
      done
    done ;;
  profile)
    for i in "${!configs[@]}"; do
      echo "== bench.profile_step gpt2 ${names[$i]}"
      # shellcheck disable=SC2086
      timeout 180 python -m bench.profile_step --model gpt2 --dtype float16 --batch 256 \
        ${configs[$i]} 2>&1 | grep -v -i warning | sed -n '/steady decode/,/host ops/p'
    done ;;
  qwen3)
    engine qwen3-0.6b bfloat16 pdl --hf --itl-batch 64
    engine qwen3-0.6b bfloat16 nopdl --no-pdl ;;
  esac
done
