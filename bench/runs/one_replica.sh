# Sourced by the bench/runs scripts that load one replica on one GPU.
# one_replica LABEL OUT_JSON [bench.load args]: gpt2, one replica, router kv, a closed loop
# of 256 users (prompt 128, 128 new tokens, 2048 requests) from 8 generator processes;
# the args given override these (argparse keeps an option's last value). Prints the
# report's result, per-replica, admission, saturation and failure lines, each led by LABEL.
one_replica() {
  local label=$1 json=$2
  shift 2
  timeout "${ONE_REPLICA_TIMEOUT_S:-200}" python -m bench.load --model gpt2 --replicas 1 \
    --device cuda --routers kv --dataset random --input-len 128 --output-len 128 \
    --concurrency 256 --num-requests 2048 --num-procs 8 --out "$json" "$@" 2>&1 \
    | grep -E "^\| kv|kv: replica|admission|SATURATED|LOST|LEAK|Error" | grep -v raylet \
    | sed "s/^/$label /"
}
