#!/usr/bin/env bash
# One CPU replica of gpt2 (float32) under bench.load at each num_cpus_per_replica given,
# e.g. `bash bench/runs/cpu_threads.sh 1 4 8 1 4 8`: Ray sets the replica's OMP_NUM_THREADS,
# so N is its torch threads. A closed loop of 32 users, prompts of 64 tokens, 32 new, 128
# requests. Prints each run's table row and replica line, led by cpus=N.
for n in "$@"; do
  timeout 200 python -m bench.load --model gpt2 --replicas 1 --device cpu --routers kv \
    --num-cpus-per-replica "$n" --dataset random --input-len 64 --output-len 32 \
    --concurrency 32 --num-requests 128 --num-procs 2 2>&1 \
    | grep -E "^\| kv|kv: replica|LOST|LEAK|Error" | grep -v raylet | sed "s/^/cpus=$n /"
done
