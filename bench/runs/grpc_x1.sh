#!/usr/bin/env bash
# Serve's gRPC handle path against Ray actor calls, one H200 (x1): a bare echo deployment
# (bench.serve_handle), TTFT at concurrency 1 through Serve (bench.cluster overhead), and
# one gpt2 replica under a closed loop of 256 users, each path in turn on the same
# deployment settings (bench.load, as ttft_split_x1.sh).
# Usage: bash bench/runs/grpc_x1.sh OUT_DIR [echo|overhead|load ...]   (~6 min for all)
set -u
. "$(dirname "$0")/one_replica.sh"
ONE_REPLICA_TIMEOUT_S=${ONE_REPLICA_TIMEOUT_S:-150}  # per bench.load run
out=${1:-results}
shift
parts=${*:-echo overhead load}
mkdir -p "$out"
for part in $parts; do
  echo "== $part $(date +%T)"
  case $part in
    echo) timeout 240 python -m bench.serve_handle --out "$out/serve_handle.json" 2>&1 \
      | grep -E "^\|" ;;
    overhead) timeout 240 python -m bench.cluster --model gpt2 --device cuda \
      --sections overhead --out "$out/overhead.json" 2>&1 | grep -E "^\|" ;;
    load)
      one_replica grpc "$out/load_grpc.json" --num-requests 4096 --num-procs 4
      one_replica actor "$out/load_actor.json" --num-requests 4096 --num-procs 4 \
        --serve-actor-calls ;;
  esac
done
