#!/usr/bin/env bash
# Where one replica's processes spend their GIL time under load (H200 x1): py-spy --gil
# on the replica's Serve process and on its engine child, while bench.load drives one
# gpt2 replica (engine_process) with 256 closed-loop users; results under $1.
# Usage: PYSPY=path/to/py-spy bash bench/runs/profile_replica_x1.sh OUT_DIR [SECONDS]
set -u
. "$(dirname "$0")/one_replica.sh"
out=${1:-results}
secs=${2:-10}
spy=${PYSPY:-py-spy}
mkdir -p "$out"
one_replica profile "$out/profile_load.json" --engine-process --num-requests 20000 \
  --num-procs 4 &
load=$!
until child=$(pgrep -f "cluster.engine_process" | head -1) && [ -n "$child" ]; do sleep 1; done
replica=$(ps -o ppid= -p "$child" | tr -d ' ')
sleep 25  # the deploy finishes, generators start, the round is under way
echo "replica $replica child $child"
"$spy" record --gil --threads --rate 250 --duration "$secs" --format raw --nonblocking \
  -p "$replica" -o "$out/replica_gil.txt" >/dev/null 2>&1 &
"$spy" record --gil --threads --rate 250 --duration "$secs" --format raw --nonblocking \
  -p "$child" -o "$out/child_gil.txt" >/dev/null 2>&1 &
# per-thread CPU over 2 s (top's second sample)
top -b -H -n 2 -d 2 -p "$replica" | awk '/^top/{n++} n==2' | sed -n 7,18p
top -b -H -n 2 -d 2 -p "$child" | awk '/^top/{n++} n==2' | sed -n 7,12p
wait $load
ls -la "$out"
