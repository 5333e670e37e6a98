"""bench.load's HTTP path: a generator process drives the OpenAI endpoint, not the Client.

Each request is POST /v1/completions with the trace's token ids as the prompt (so the token
counts are exact), max_tokens = its output length with ignore_eos, greedy, `stream: true`
and `stream_options.include_usage`: Server-Sent Events, one `data: {...}` per chunk (its
choices' token_ids are the new tokens), a usage chunk, then `data: [DONE]`. The record is
the one the Client path fills (bench.load_worker.send_one): each chunk's arrival time and
token count, the finish reason, the end. Outcomes: a 503 (the ingress's OverloadedError)
is "rejected", another status or an error event is an "error" typed by it, and a stream
whose usage is missing or disagrees with the tokens seen is an "error" too, so a miscount
cannot pass as throughput. One aiohttp session per generator process.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from bench.load_metrics import RequestRecord
from bench.load_workload import RequestSpec

REJECTED_STATUS = 503  # the ingress's answer to OverloadedError (with Retry-After)
REJECTED_EVENT = "overloaded"  # the same, once the stream has started
DATA = b"data: "


def completion_body(spec: RequestSpec) -> dict:
    return {
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def open_session() -> aiohttp.ClientSession:
    # limit=0: aiohttp's default pool of 100 connections would hold a closed loop's users
    # beyond the 100th in the client, unmeasured, instead of in the server.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )


def _fail(record: RequestRecord, outcome: str, error_type: str, message: str) -> None:
    record.outcome, record.error_type, record.error_message = outcome, error_type, message[:300]


async def send_one_http(
    session: aiohttp.ClientSession, url: str, spec: RequestSpec, record: RequestRecord, t0: float
) -> None:
    """Stream one request from the ingress at url, filling its record; leaves it "lost"
    if it neither ends nor fails."""
    sent = time.perf_counter()
    record.sent_s = sent - t0
    usage = None
    try:
        async with session.post(f"{url}/v1/completions", json=completion_body(spec)) as response:
            if response.status != 200:
                outcome = "rejected" if response.status == REJECTED_STATUS else "error"
                _fail(record, outcome, f"HTTP{response.status}", await response.text())
                return
            async for line in response.content:  # one SSE line; events end with a blank one
                if not line.startswith(DATA):
                    continue
                data = line[len(DATA) :].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    kind = event["error"].get("type", "?")
                    outcome = "rejected" if kind == REJECTED_EVENT else "error"
                    _fail(record, outcome, f"SSE:{kind}", event["error"].get("message", ""))
                    return
                for choice in event["choices"]:
                    if choice.get("token_ids"):
                        record.chunk_times_s.append(time.perf_counter() - sent)
                        record.chunk_num_tokens.append(len(choice["token_ids"]))
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                usage = event.get("usage") or usage
        if record.finish_reason is None:
            record.error_message = "stream ended without a finish reason"
            return
        seen = (record.num_prompt_tokens, record.num_output_tokens)
        if usage is None:
            _fail(record, "error", "UsageMissing", "no usage chunk before [DONE]")
        elif (usage["prompt_tokens"], usage["completion_tokens"]) != seen:
            _fail(record, "error", "UsageMismatch", f"usage {usage}, tokens seen {seen}")
        else:
            record.outcome = "ok"
    except asyncio.CancelledError:
        record.error_message = "no completion or typed error before the run's timeout"
        raise
    except Exception as exc:  # a connection or protocol failure: an error, by type
        _fail(record, "error", type(exc).__name__, str(exc))
    finally:
        if record.outcome != "lost":
            record.end_s = time.perf_counter() - t0
