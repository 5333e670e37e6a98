#!/usr/bin/env bash
# Does one gpt2 replica serve less when the host's other cores are busy? The same
# bench.load run (one replica, 256 users, 8 generator processes) alone, then with
# BUSY (default 48) single-core busy loops running on the host, as the other replicas and
# their generators of a 4-replica run would be. Usage: bash bench/runs/host_contention_x4.sh OUT
set -u
out=${1:-results}
mkdir -p "$out"
run() {
  timeout 200 python -m bench.load --model gpt2 --replicas 1 --device cuda --routers kv \
    --dataset random --input-len 128 --output-len 128 --concurrency 256 \
    --num-requests 2048 --num-procs 8 --out "$out/contention_$1.json" 2>&1 \
    | grep -E "^\| kv|kv: replica|admission|LOST|LEAK|Error" | grep -v raylet | sed "s/^/$1 /"
}
run alone
pids=()
for _ in $(seq "${BUSY:-48}"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
run busy
kill "${pids[@]}"
