#!/usr/bin/env bash
# One replica on one H200, engine thread vs engine process (ClusterConfig.engine_process),
# and Serve's access log on vs off; results under $1 (default results/).
# Usage: [OVERHEAD=1] bash bench/runs/engine_process_x1.sh OUT_DIR [MODEL ...]
# (about 1.5 min per bench.load run: one model per call fits the device's 10 min limit)
# Each model: one replica, 256 closed-loop users in 8 generator processes, prompt 128,
# 128 new tokens, 2048 requests, router kv; the rows differ only in the flag named.
set -u
. "$(dirname "$0")/one_replica.sh"
ONE_REPLICA_TIMEOUT_S=${ONE_REPLICA_TIMEOUT_S:-150}  # per bench.load run
out=${1:-results}
shift || true
models=${*:-gpt2 qwen3-0.6b}
mkdir -p "$out"
# Serve's TTFT overhead at concurrency 1 (one model; ~1.5 min each) with OVERHEAD=1.
if [ "${OVERHEAD:-0}" = 1 ]; then
  for mode in thread process; do
    flag="--engine-thread"; [ $mode = process ] && flag="--engine-process"
    timeout 200 python -m bench.cluster --model "${models%% *}" --device cuda \
      --sections overhead $flag --out "$out/overhead_$mode.json" 2>&1 \
      | grep -E "^\||Error" | grep -v raylet | tail -6 | sed "s/^/$mode /"
  done
fi
run() {  # model, name, extra bench.load args
  local model=$1 name=$2
  shift 2
  one_replica "$model $name" "$out/engine_${model}_${name}.json" --model "$model" "$@"
}
for model in $models; do
  # The peer: the same engine offline, 256 sequences, prompt 128, 128 new tokens.
  timeout 150 python -m bench.engine --model "$model" --batch 256 --prompt-len 128 \
    --max-new 128 --out "$out/engine_${model}_offline.json" 2>&1 \
    | grep -E "^\||Error" | tail -4 | sed "s/^/$model offline /"
  run "$model" thread --engine-thread
  run "$model" process --engine-process
  run "$model" thread_accesslog --engine-thread --access-log
done
