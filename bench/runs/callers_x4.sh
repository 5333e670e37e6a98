#!/usr/bin/env bash
# Does a gpt2 replica serve less with more callers? One replica, 256 users, the same trace
# from 8 and from 32 generator processes (each process is one caller with its own carrier
# on the replica; a 4-replica run of load_x4.sh with PROCS=8 gives each replica 32).
# Run on a 64-core host so that the generators do not compete for cores.
# Usage: bash bench/runs/callers_x4.sh OUT_DIR
set -u
. "$(dirname "$0")/one_replica.sh"
out=${1:-results}
mkdir -p "$out"
for procs in 8 32; do
  one_replica "callers=$procs" "$out/callers_$procs.json" --num-requests 4096 --num-procs "$procs"
done
