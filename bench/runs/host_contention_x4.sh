#!/usr/bin/env bash
# Does one gpt2 replica serve less when the host's other cores are busy? The same
# bench.load run (one replica, 256 users, 8 generator processes) alone, then with
# BUSY (default 48) single-core busy loops running on the host, as the other replicas and
# their generators of a 4-replica run would be. Usage: bash bench/runs/host_contention_x4.sh OUT
set -u
. "$(dirname "$0")/one_replica.sh"
out=${1:-results}
mkdir -p "$out"
one_replica alone "$out/contention_alone.json"
pids=()
for _ in $(seq "${BUSY:-48}"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
one_replica busy "$out/contention_busy.json"
kill "${pids[@]}"
