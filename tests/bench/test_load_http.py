"""bench.load_http: a generator's requests over the OpenAI endpoint (SSE), against a local
aiohttp server that streams the ingress's events (cluster.openai_api's response models)."""

from __future__ import annotations

import asyncio
import math
import time
from functools import partial

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.load_http import open_session, send_one_http
from bench.load_metrics import RequestRecord, compute_metrics
from bench.load_worker import WorkerPlan, _closed_loop
from bench.load_workload import RequestSpec
from cluster.openai_api import CompletionChoice, CompletionResponse, Usage


class FakeIngress:
    """POST /v1/completions as cluster.ingress streams it: one event per chunk (the last
    chunk carries two tokens and the finish reason), the usage chunk, [DONE]; `script`
    makes it misbehave."""

    def __init__(self, script: str = "ok") -> None:
        self.script = script
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.script == "503":
            error = {"error": {"message": "expected wait 3.0 s", "type": "overloaded"}}
            return web.json_response(error, status=503, headers={"Retry-After": "3"})
        if self.script == "400":
            return web.json_response({"error": {"message": "max_tokens: bad"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = CompletionResponse(id="cmpl-1", model="m", choices=[])
        n = body["max_tokens"]
        chunks = [[100 + i] for i in range(n - 2)] + [[100 + n - 2, 100 + n - 1]]
        for i, token_ids in enumerate(chunks):
            last = i == len(chunks) - 1
            choice = CompletionChoice(
                index=0, text="x", finish_reason="length" if last else None, token_ids=token_ids
            )
            await self._event(response, head.model_copy(update={"choices": [choice]}))
            await asyncio.sleep(0.005)
            if self.script == "error-event":
                await response.write(b'data: {"error": {"message": "boom", "type": "replica"}}\n\n')
                break
        completion_tokens = n + (1 if self.script == "bad-usage" else 0)
        usage = Usage.of(len(body["prompt"]), completion_tokens)
        if self.script != "no-usage":
            await self._event(response, head.model_copy(update={"usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return response

    @staticmethod
    async def _event(response: web.StreamResponse, event: CompletionResponse) -> None:
        await response.write(f"data: {event.model_dump_json()}\n\n".encode())


async def _serve(ingress: FakeIngress, run):
    app = web.Application()
    app.router.add_post("/v1/completions", ingress.completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    session = open_session()
    try:
        return await run(session, str(server.make_url("")).rstrip("/"))
    finally:
        await session.close()
        await server.close()


def _send(ingress: FakeIngress, spec: RequestSpec) -> RequestRecord:
    record = RequestRecord(spec.index, len(spec.prompt_token_ids), spec.max_tokens, 0.0)

    async def run(session, url) -> None:
        await send_one_http(session, url, spec, record, time.perf_counter())

    asyncio.run(_serve(ingress, run))
    return record


def test_every_token_and_the_usage_are_recorded() -> None:
    ingress = FakeIngress()
    record = _send(ingress, RequestSpec(0, [5, 6, 7], 6, 0.0))
    assert (record.outcome, record.finish_reason, record.error_type) == ("ok", "length", None)
    assert record.num_output_tokens == 6
    assert record.chunk_num_tokens == [1, 1, 1, 1, 2]  # a chunk's tokens arrive together
    assert record.chunk_times_s == sorted(record.chunk_times_s)
    assert 0 < record.ttft_s < record.e2e_s <= record.end_s - record.sent_s
    (body,) = ingress.bodies
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 6
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "script,outcome,error_type",
    [
        ("503", "rejected", "HTTP503"),
        ("400", "error", "HTTP400"),
        ("error-event", "error", "SSE:replica"),
        ("bad-usage", "error", "UsageMismatch"),
        ("no-usage", "error", "UsageMissing"),
    ],
)
def test_a_503_is_a_rejection_and_other_failures_are_typed_errors(
    script: str, outcome: str, error_type: str
) -> None:
    record = _send(FakeIngress(script), RequestSpec(3, [5, 6, 7], 4, 0.0))
    assert (record.outcome, record.error_type) == (outcome, error_type)
    assert not math.isnan(record.end_s)  # ended: counted, not lost
    m = compute_metrics([record], [3])
    assert (m["lost"], m["completed"]) == (0, 0)
    assert m["rejected" if outcome == "rejected" else "errors"] == 1


def test_a_refused_connection_is_a_typed_error() -> None:
    record = RequestRecord(0, 1, 2, 0.0)

    async def run() -> None:
        session = open_session()
        try:  # port 9 (discard): nothing listens there
            await send_one_http(
                session, "http://127.0.0.1:9", RequestSpec(0, [1], 2, 0.0), record, 0.0
            )
        finally:
            await session.close()

    asyncio.run(run())
    assert record.outcome == "error" and "Connect" in record.error_type


def test_a_closed_loop_over_http_keeps_its_users_in_flight() -> None:
    ingress = FakeIngress()
    trace = [RequestSpec(i, [1 + i, 2], 3 + i % 3, 0.0) for i in range(7)]
    plan = WorkerPlan(0, "app", trace, concurrency=2, timeout_s=30.0)
    records = {s.index: RequestRecord(s.index, 2, s.max_tokens, 0.0) for s in trace}

    async def run(session, url) -> None:
        tasks = await _closed_loop(partial(send_one_http, session, url), plan, records, 0.0)
        await asyncio.gather(*tasks)

    asyncio.run(_serve(ingress, run))
    assert all(r.outcome == "ok" for r in records.values())
    assert [r.num_output_tokens for r in records.values()] == [s.max_tokens for s in trace]
    assert ingress.max_in_flight == 2 and len(ingress.bodies) == 7
