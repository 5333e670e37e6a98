#!/usr/bin/env bash
# The issue-6 load runs on one host with 4 GPUs (H200 x4), results under $1 (default results/).
# Usage: bash bench/runs/load_x4.sh OUT_DIR [scaling|prefix|queue|all]
set -u
out=${1:-results}
what=${2:-all}
mkdir -p "$out"
if [[ $what == scaling || $what == all ]]; then
  # Throughput scaling, one replica per GPU, closed loop of 256 users per replica; the 1- and
  # 4-replica runs first, then 2 replicas (RUNS="model:n ..." picks; ROUTERS="kv,..." adds
  # routers, each run over the same trace; EXTRA="--engine-thread ..." adds bench.load flags;
  # PROCS generator processes per replica, default 4).
  for run in ${RUNS:-gpt2:1 gpt2:4 qwen3-0.6b:1 qwen3-0.6b:4 gpt2:2 qwen3-0.6b:2}; do
    model=${run%:*}
    n=${run#*:}
    echo "== $model x$n $(date +%T)"
    timeout 240 python -m bench.load --model "$model" --replicas "$n" --device cuda \
      --routers "${ROUTERS:-kv}" ${EXTRA:-} \
      --dataset random --input-len 128 --output-len 128 --concurrency $((256 * n)) \
      --num-requests $((2048 * n)) --num-procs $((${PROCS:-4} * n)) --out "$out/scale_${model}_${n}.json" \
      2>&1 | grep -E "^\||: replica|admission|SATURATED|LOST|LEAK|deployed|Error" | grep -v raylet | tail -20
  done
fi
if [[ $what == prefix || $what == all ]]; then
  # Shared prefixes that do not all fit in one replica's cache: 32 x 4096 tokens against
  # 3072 blocks (49K tokens) per replica, so a replica holds about a third of them unless
  # the router keeps each prefix on one replica; the same open-loop trace under each router
  # (RATE req/s, default 480, for 6 s; REPLICAS, default 4, with 8 prefixes each).
  # RATES="200 240" runs each rate in turn; EXTRA adds bench.load flags.
  replicas=${REPLICAS:-4}
  for rate in ${RATES:-${RATE:-480}}; do
    echo "== prefix, $replicas replicas, $rate req/s $(date +%T)"
    timeout ${PREFIX_TIMEOUT_S:-280} python -m bench.load --model qwen3-0.6b --replicas "$replicas" --device cuda \
      --num-blocks 3072 --routers "${ROUTERS:-prefix,kv,serve-pow2}" --dataset prefix \
      --num-prefixes $((8 * replicas)) --prefix-len 4096 \
      --input-len 64 --output-len 32 --rate "$rate" --num-requests $((rate * 6)) \
      --slo-ttft-ms 300 --slo-tpot-ms 50 --num-procs 8 ${EXTRA:-} --out "$out/prefix_qwen3_$rate.json" \
      2>&1 | grep -E "^\||SATURATED|LOST|LEAK|leak check|deployed|Error|ratios|hit rate|admission|: replica|placement|routing trace" \
      | tail -60
  done
fi
if [[ $what == queue || $what == all ]]; then
  # The same trace, kvfleet's prefix policy letting replicas queue past their free blocks
  # (RouterConfig.queue_fraction; the simulator's case for it is in BENCHMARKS.md).
  for q in 0.1 0.25 0.5; do
    timeout 300 python -m bench.load --model qwen3-0.6b --replicas 4 --device cuda \
      --num-blocks 3072 --routers prefix --queue-fraction "$q" --dataset prefix \
      --num-prefixes 32 --prefix-len 4096 --input-len 64 --output-len 32 --rate 480 \
      --num-requests 2880 --slo-ttft-ms 300 --slo-tpot-ms 50 --num-procs 8 \
      --out "$out/prefix_qwen3_q$q.json" 2>&1 | grep -E "^\| prefix|LOST|LEAK|Error" | tail -3
  done
fi
