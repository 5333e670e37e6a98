#!/usr/bin/env bash
# NVIDIA AIPerf's stock streaming modes against `python -m cluster serve` of a tiny Qwen3
# directory with a real BPE tokenizer and chat template (tests/replica/tiny_chat_model.py).
#
#   bench/aiperf.sh [REQUESTS] [CONCURRENCY]      (default 20 4; CPU is fine)
#
# AIPerf lives in its own virtual environment, never in .venv:
#   python3 -m venv /work/aiperf-venv && /work/aiperf-venv/bin/pip install aiperf
# (AIPERF=path/to/aiperf overrides where it is looked for; PORT, the serving port.)
# Checks, per mode: 0 errors; the server's prompt usage equals AIPerf's own tokenizer
# count of each prompt (chat: plus the template's fixed tokens); the usage AIPerf read
# equals the engine's vllm:generation_tokens_total over the run and requests x --osl.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS="${1:-20}"
CONCURRENCY="${2:-4}"
AIPERF="${AIPERF:-/work/aiperf-venv/bin/aiperf}"
PORT="${PORT:-8123}"
ISL=32
OSL=16
MODEL_NAME=tiny-qwen3
WORK="$(mktemp -d /tmp/kvfleet-aiperf.XXXXXX)"
URL="http://127.0.0.1:$PORT"
[[ -x "$AIPERF" ]] || { echo "no aiperf at $AIPERF (see the usage above)" >&2; exit 2; }

.venv/bin/python -c "import pathlib, tests.replica.tiny_chat_model as m; \
m.save_chat_model(pathlib.Path('$WORK/model'))" >/dev/null 2>&1
.venv/bin/python -m cluster serve --model "$WORK/model" --device cpu --num-replicas 1 \
  --num-blocks 256 --max-num-seqs 16 --served-model-name "$MODEL_NAME" --port "$PORT" \
  --blocking >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
# SIGTERM (a background job ignores SIGINT): the local Ray that ray.init started goes
# down with its driver (Ray's reaper).
trap 'kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "$URL/health" >/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$WORK/server.log"; exit 1; }
  sleep 1
done
curl -sf "$URL/health" >/dev/null || { echo "/health never answered 200" >&2; exit 1; }

generated() {  # the engine's generation token counter, summed over replicas
  curl -sf "$URL/metrics" | awk '/^vllm:generation_tokens_total/ {s += $NF} END {print s + 0}'
}

for mode in completions chat; do
  before=$(generated)
  "$AIPERF" profile --model "$MODEL_NAME" --url "$URL" --endpoint-type "$mode" --streaming \
    --tokenizer "$WORK/model" --request-count "$REQUESTS" --concurrency "$CONCURRENCY" \
    --isl "$ISL" --isl-stddev 0 --osl "$OSL" --extra-inputs ignore_eos:true \
    --random-seed 0 --ui none --output-artifact-dir "$WORK/$mode" >"$WORK/$mode.log" 2>&1
  after=$(generated)
  .venv/bin/python - "$WORK" "$mode" "$REQUESTS" "$OSL" "$((after - before))" <<'EOF'
import json, sys
from transformers import AutoTokenizer

from cluster.client import chat_prompt_ids

work, mode, num_requests, osl, server_generated = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
summary = json.load(open(f"{work}/{mode}/profile_export_aiperf.json"))
records = [json.loads(line) for line in open(f"{work}/{mode}/profile_export.jsonl")]
value = lambda m, name: m[name]["value"]  # noqa: E731
# Chat: the server's prompt is the template around AIPerf's text (role markers, the
# generation prompt), a fixed number of tokens.
tokenizer = AutoTokenizer.from_pretrained(f"{work}/model")
overhead = 0
if mode == "chat":
    overhead = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": ""}]))
errors = sum(1 for r in records if r.get("error")) + len(summary.get("error_summary") or [])
ms = [r["metrics"] for r in records]
prompt_mismatch = sum(value(m, "usage_prompt_tokens") != value(m, "input_sequence_length") + overhead for m in ms)
usage_out = sum(value(m, "usage_completion_tokens") for m in ms)
client_out = sum(value(m, "output_sequence_length") for m in ms)
ttft, itl = summary["time_to_first_token"], summary["inter_token_latency"]
print(f"{mode}: {len(ms)} requests, {errors} errors; output tokens: usage {usage_out}, "
      f"server counter {server_generated}, AIPerf's re-tokenized text {client_out}; "
      f"prompts off by more than the template: {prompt_mismatch}; TTFT p50 {ttft['p50']:.0f} "
      f"p99 {ttft['p99']:.0f} ms; ITL p50 {itl['p50']:.1f} p99 {itl['p99']:.1f} ms")
ok = (errors == 0 and len(ms) == num_requests and prompt_mismatch == 0
      and usage_out == server_generated == num_requests * osl)
sys.exit(0 if ok else 1)
EOF
done
