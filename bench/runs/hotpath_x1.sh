#!/usr/bin/env bash
# The decode hot path on one H200 (issue 4): where the gpt2 B=256 step's wall goes, and
# the engine table with its peers. Parts (PARTS, default "diag"):
#   diag     bench.engine gpt2 fp16 at 256 (step spread: slow steps and their phases) and
#            bench.profile_step's timeline of 20 engine steps (GPU busy share, idle gaps)
#   engine   bench.engine gpt2 fp16, batch 1 and 256, with HF and the ITL runs (REPEAT); each
#            batch size RUNS times (default 3), the table the median run
#   ab       bench.engine gpt2 fp16 at 256 with each EXTRA_AB flag, then without (REPEAT),
#            each with AB_ARGS (e.g. "--hf --repeat 3")
#   itl      bench.engine gpt2 fp16 ITL runs at batch 64 with each ITL_AB flag (default
#            --mixed-prefill-tokens=0), then without (REPEAT)
#   qwen3    bench.engine qwen3-0.6b bf16 with HF and the ITL runs
#   tune     bench.kernels --tune of decode attention at the engine's contexts (TUNE_SHAPES,
#            TUNE_CASES)
#   fold     bench.gemm --fold: GPT-2's sublayer boundaries, add + norm apart or folded
#            into the projections
#   overlap  bench.overlap: can decode attention share the GPU with the projections (a
#            read and a candidate attention on few programs, beside one layer's projections)
#   sampling bench.sampling's top-p kernels at 1, 64 and 256 rows, with each of
#            SPLIT_ROUNDS split rounds at every size (unset: kernels.sampling's rule)
#   tests    the gpu tests of the engine and the kernels
#   kernels  every kernel test, natively
# Usage: PARTS="diag engine" bash bench/runs/hotpath_x1.sh OUT_DIR
set -u
out=${1:-results}
mkdir -p "$out"
engine() {  # model, dtype, name, extra bench.engine args
  local model=$1 dtype=$2 name=$3
  shift 3
  echo "== bench.engine $model $name $*"
  timeout 300 python -m bench.engine --model "$model" --dtype "$dtype" "$@" \
    --out "$out/engine_${model}_$name.json" 2>&1 | grep -v -i warning | tail -17
}
for part in ${PARTS:-diag}; do
  case $part in
  diag)
    engine gpt2 float16 diag --batch 256
    engine gpt2 float16 diag_nogc --batch 256 --no-gc
    echo "== bench.profile_step gpt2 256"
    timeout 200 python -m bench.profile_step --model gpt2 --dtype float16 --batch 256 \
      2>&1 | grep -v -i warning | sed -n '/steady decode/,$p' | head -60 ;;
  engine)
    for rep in $(seq "${REPEAT:-1}"); do
      engine gpt2 float16 "r$rep" --batch 1 256 --hf --itl-batch 64 --repeat "${RUNS:-3}"
    done ;;
  ab)
    for rep in $(seq "${REPEAT:-1}"); do
      for flag in ${EXTRA_AB:-}; do
        # shellcheck disable=SC2086  # AB_ARGS: a list of arguments
        engine gpt2 float16 "ab${flag}_r$rep" --batch 256 "$flag" ${AB_ARGS:-}
        # shellcheck disable=SC2086
        engine gpt2 float16 "ab_default_r$rep" --batch 256 ${AB_ARGS:-}
      done
    done ;;
  itl)
    for rep in $(seq "${REPEAT:-1}"); do
      for flag in ${ITL_AB:---mixed-prefill-tokens=0}; do
        engine gpt2 float16 "itl${flag}_r$rep" --batch 1 --itl-batch 64 "$flag"
        engine gpt2 float16 "itl_default_r$rep" --batch 1 --itl-batch 64
      done
    done ;;
  qwen3)
    engine qwen3-0.6b bfloat16 hf --batch 1 256 --hf --itl-batch 64 --repeat "${RUNS:-3}" ;;
  tune)
    timeout 300 python -m bench.kernels --tune --shapes "${TUNE_SHAPES:-gpt2}" \
      --tune-cases "${TUNE_CASES:-256x192,64x528}" --out "$out/tune.json" 2>&1 | grep -v -i warning | sed -n '/best config/,$p' ;;
  fold)
    timeout 200 python -m bench.gemm --fold --rows 32 64 128 256 --out "$out/gemm_fold.json" \
      2>&1 | grep -v -i warning | tail -12 ;;
  overlap)
    timeout 300 python -m bench.overlap --rows 128 256 --out "$out/overlap.json" \
      2>&1 | grep -v -i warning | tail -70 ;;
  sampling)
    # shellcheck disable=SC2086  # SPLIT_ROUNDS: a list of values
    timeout 500 python -m bench.sampling --rows 1 64 256 --kinds "T=0.8 top_p=0.95" \
      ${SPLIT_ROUNDS:+--split-rounds $SPLIT_ROUNDS} --out "$out/sampling.json" 2>&1 |
      grep -v -i warning | sed -n '/^| vocab/,$p' ;;
  tests)
    timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests/replica tests/kernels \
      2>&1 | tail -4 ;;
  kernels)
    timeout 400 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -4 ;;
  esac
done
