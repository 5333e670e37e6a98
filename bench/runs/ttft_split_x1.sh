#!/usr/bin/env bash
# Where a request's time goes before its first token, one gpt2 replica on one H200:
# send -> engine admission (the ack's admission time against the generator's clock,
# same host), engine admission -> first token (the replica's counters), with the
# engine in a child process or a thread, 4 or 16 caller processes, 256 or 512 users.
# Usage: bash bench/runs/ttft_split_x1.sh OUT_DIR   (~1 min per row)
set -u
. "$(dirname "$0")/one_replica.sh"
ONE_REPLICA_TIMEOUT_S=${ONE_REPLICA_TIMEOUT_S:-150}  # per bench.load run
out=${1:-results}
mkdir -p "$out"
run() {  # name, generator processes, users, extra bench.load args
  local name=$1 procs=$2 users=$3
  shift 3
  one_replica "$name" "$out/split_$name.json" --concurrency "$users" --num-requests 4096 \
    --num-procs "$procs" "$@"
}
run process_p4 4 256 --engine-process
run process_p16 16 256 --engine-process
run process_p4_u512 4 512 --engine-process
run thread_p4 4 256 --engine-thread
