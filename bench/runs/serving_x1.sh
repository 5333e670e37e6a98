#!/usr/bin/env bash
# The serving path on one H200 (issues 5 and 6), results under $1 (default results/).
# Usage: bash bench/runs/serving_x1.sh OUT_DIR [MODEL]
#  - bench.cluster's Serve overhead (TTFT p50 at concurrency 1), handle routing on the
#    caller's loop against Serve's router thread;
#  - one replica under 256 closed-loop users in 8 generator processes (8 callers, more
#    than the default message budget of 4), A/B of the serving-path changes: old path
#    (every step to every caller, Serve's router thread), caller-loop routing alone,
#    then message budgets 4 (each caller every 2 steps) and 2 (every 4 steps).
set -u
. "$(dirname "$0")/one_replica.sh"
ONE_REPLICA_TIMEOUT_S=${ONE_REPLICA_TIMEOUT_S:-110}  # per bench.load run
out=${1:-results}
model=${2:-gpt2}
mkdir -p "$out"
timeout 200 python -m bench.cluster --model "$model" --device cuda --sections overhead \
  --out "$out/cluster_overhead.json" 2>&1 | grep -E "^\||^###|Error" | grep -v raylet | tail -8
run() {  # name, extra bench.load args
  local name=$1
  shift
  one_replica "$name" "$out/serving_${name}.json" --model "$model" "$@"
}
# On 2026-11-22 (BENCHMARKS.md) the replicas ran their methods on a thread of their own in
# the first four runs (then the default; budget4_mainloop set the main loop, now the
# default through cluster/app.py REPLICA_ENV_VARS, which this script cannot undo).
run old --carrier-messages-per-step 1000
run budget4 --carrier-messages-per-step 4 --route-on-caller-loop
run loop --carrier-messages-per-step 1000 --route-on-caller-loop
run budget2 --carrier-messages-per-step 2 --route-on-caller-loop
