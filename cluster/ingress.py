"""OpenAI-compatible HTTP ingress (Serve FastAPI integration) in front of LLMServer.

POST /v1/completions (prompt: a string, token ids, or a list of either: one choice per
prompt, each its own request, run concurrently), POST /v1/chat/completions (the model's
chat template), GET /v1/models, POST /tokenize and /detokenize, GET /version, /health
(503 until every replica answers), /stats. Bodies are cluster.openai_api's pydantic
models. Bad input (malformed JSON, an invalid known field) -> 400 naming the field;
unknown fields are ignored with one warning (a log line and the x-kvfleet-ignored-fields
header); a body over MAX_BODY_BYTES -> 413, one not received within the body timeout -> 408
(its connection closed), one nested deeper than MAX_JSON_DEPTH -> 400, headers over
MAX_HEADER_BYTES -> 431; with an api_key, every route but /health needs `Authorization:
Bearer KEY` (401 otherwise); OverloadedError -> 503 with Retry-After, also before the
body is read while this replica's event loop runs later than ingress_max_loop_lag_s
(cluster.ingress_load: new completions and chats only); a request whose client has gone
by the time it is parsed is dropped before it is routed (499, which no one reads); a
replica failing mid-request -> 502 (or, once an SSE stream has started, an error event
before [DONE]); anything else -> a typed 500. An SSE stream is one unit per request
anyway, so it carries one event per engine step per request. A client that disconnects
aborts its requests (their streams are closed, which aborts them on their replicas).
Text, stop strings and their hold-back come from the Client (replica.detokenizer).

An ingress replica that dies (killed, its node lost) mid-stream: HAProxy aborts each
client connection it was writing in the middle of the chunked body, with no `[DONE]` and
no error event (nothing is left to write one), so the client sees a broken connection:
httpx raises RemoteProtocolError ("incomplete chunked read"), the openai package
APIConnectionError; never a stream that ends as if complete. A request the dead replica
had not begun answering is retried by HAProxy on another ingress replica
(cluster.app.HAPROXY_RETRY_ON). tests/cluster/test_ingress_failover shows both.
"""

# No `from __future__ import annotations` here: FastAPI reads the handler signatures
# (`request: Request`) at runtime, through Serve's class-based ingress wrapper. Every
# helper the handlers call is defined above the class: Serve pickles the wrapped class
# with the module globals that exist when it is decorated.

import asyncio
import hmac
import importlib.metadata
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError

from cluster.client import Chunk, Client, Completion, chat_prompt_ids
from cluster.errors import ReplicaError
from cluster.ingress_load import LoopLagMeter, LoopLagShedder
from cluster.metrics import exposition
from cluster.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeRequest,
    Usage,
    parse,
)
from cluster.openai_format import Echo, best_of, chat_logprobs, choice_logprobs
from cluster.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from cluster.request_group import UsageCounter, gather_or_cancel, open_streams
from cluster.sse import ChatDeltas, CompletionChunks
from replica.stats import ReplicaStats
from router.errors import OverloadedError

api = FastAPI(title="kvfleet")
logger = logging.getLogger("ray.serve")

MAX_BODY_BYTES = 1 << 20
# json.loads recurses once per level: past ~1,000 levels it raised RecursionError (a bare
# 500), and bodies of 500-979 levels failed on their way to a replica (a 502). OpenAI's
# deepest bodies (tool schemas, content parts) stay far below 64.
MAX_JSON_DEPTH = 64
# Checked here, after Serve's proxy (uvicorn with httptools, which takes any size) has
# read them: it bounds what reaches the handlers, not the proxy (docs/design.md).
MAX_HEADER_BYTES = 64 << 10
IGNORED_FIELDS_HEADER = "x-kvfleet-ignored-fields"
DONE_EVENT = "data: [DONE]\n\n"


class BodyTooLargeError(ValueError):
    """The request body is over MAX_BODY_BYTES."""


class BodyTimeoutError(ValueError):
    """The request body did not arrive within the ingress's body timeout."""


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


def _error_response(exc: Exception) -> JSONResponse:
    """The typed JSON error for an exception raised before a response started."""
    if isinstance(exc, BodyTooLargeError):
        return _error(413, str(exc), "invalid_request_error")
    if isinstance(exc, BodyTimeoutError):
        # Close: the rest of a body that may still come must not be read as a request.
        return _error(408, str(exc), "invalid_request_error", {"Connection": "close"})
    if isinstance(exc, ValueError):
        return _error(400, str(exc), "invalid_request_error")
    if isinstance(exc, OverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return _error(503, str(exc), "overloaded", {"Retry-After": retry_after})
    if isinstance(exc, BackPressureError):  # a full Serve queue the Client did not map
        retry_after = str(max(1, math.ceil(exc.retry_after_s or 1.0)))
        return _error(503, str(exc), "overloaded", {"Retry-After": retry_after})
    if isinstance(exc, ReplicaError):
        return _error(502, str(exc), "replica_error")
    # Never a hang or a bare 500 page: a typed JSON error.
    return _error(500, f"internal error: {exc!r}", "internal_error")


def _error_event(exc: Exception) -> str:
    """An error once an SSE stream has started: an event before [DONE]."""
    kind = "replica_error" if isinstance(exc, ReplicaError) else "internal_error"
    message = str(exc) if isinstance(exc, ReplicaError) else f"internal error: {exc!r}"
    return f"data: {json.dumps({'error': {'message': message, 'type': kind}})}\n\n"


async def _read_body(request: Request, timeout_s: float) -> bytes:
    """The request body, refused (BodyTooLargeError) past MAX_BODY_BYTES without reading it
    all, and (BodyTimeoutError) when it has not all arrived within timeout_s."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLargeError(f"body: {declared} bytes exceeds the limit of {MAX_BODY_BYTES}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > MAX_BODY_BYTES:
                    raise BodyTooLargeError(f"body: exceeds the limit of {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        raise BodyTimeoutError(f"body: not received within {timeout_s:g} s") from None
    return bytes(body)


def _check_json_depth(body: bytes) -> None:
    """ValueError naming body when its arrays and objects nest deeper than MAX_JSON_DEPTH,
    found on the raw bytes in one pass (strings taken out first), before json.loads
    recurses. A body with no more openers than the limit cannot nest past it: two C-level
    counts, the whole cost for almost every request."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return
    depth = 0
    for byte in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        depth += _DEPTH_STEP[byte]
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels")


async def _json_body(request: Request, timeout_s: float) -> Any:
    body = await _read_body(request, timeout_s)
    _check_json_depth(body)
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError("body: not valid JSON") from None
    except RecursionError:  # unreachable past _check_json_depth; never a bare 500
        raise ValueError(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None


def _client_gone() -> JSONResponse:
    """The answer to a request whose client left before it was routed: nginx's 499
    ("client closed request"), for the access log; no one is there to read it. Checked
    once the body is parsed (starlette's is_disconnected reads a pending message, which
    before then would be the body): a request that waited behind a busy loop (whose
    client timed out meanwhile) costs no routing and no engine time."""
    return _error(499, "the client closed the connection", "client_closed_request")


def _unauthorized() -> JSONResponse:
    """OpenAI's answer to a missing or wrong key (its client raises AuthenticationError)."""
    error = {
        "message": "Authorization: this server needs the header `Authorization: Bearer "
        "<api key>` with its api key",
        "type": "invalid_request_error",
        "code": "invalid_api_key",
    }
    return JSONResponse({"error": error}, 401, headers={"WWW-Authenticate": "Bearer"})


def _public_stats(stats: ReplicaStats) -> dict:
    """stats for /stats: the cached prefix hashes only counted. The hashes are chained
    and unsalted, so a client that hashes a guessed prompt could match them and learn
    what another client sent; the router reads them inside the cluster."""
    public = {f.name: getattr(stats, f.name) for f in fields(stats)}
    public["num_cached_prefix_hashes"] = len(public.pop("cached_prefix_hashes"))
    return public


def _sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def _with_ignored_fields(response: Response, ignored: list[str], route: str) -> Response:
    if ignored:
        names = ", ".join(ignored)
        logger.warning("%s: ignored unknown field(s): %s", route, names)
        response.headers[IGNORED_FIELDS_HEADER] = names
    return response


def _kvfleet_version() -> str:
    return importlib.metadata.version("kvfleet")


@serve.deployment(name="Ingress", max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress:
    """model_path: the engine's model (a directory or a preset); model_name: its id in
    the API (ClusterConfig.model_name); num_replicas: how many /health waits for;
    api_key, body_timeout_s and max_loop_lag_s: ClusterConfig's api_key,
    http_body_timeout_s and ingress_max_loop_lag_s (None or 0: never shed);
    loop_lag_meter_factory: makes what reads the loop's lag
    (cluster.ingress_load.LoopLagMeter)."""

    def __init__(
        self,
        llm_handle: Any,
        model_path: str,
        model_name: str,
        num_replicas: int,
        api_key: str | None = None,
        body_timeout_s: float = 10.0,
        submit_group_size: int = 1,
        max_loop_lag_s: float | None = None,
        loop_lag_meter_factory: Callable[[], LoopLagMeter] = LoopLagMeter,
    ) -> None:
        self.model_path = model_path
        self.model_name = model_name
        self.num_replicas = num_replicas
        self.api_key = None if api_key is None else api_key.encode()
        self.body_timeout_s = body_timeout_s
        self.shedder = LoopLagShedder(max_loop_lag_s or None, loop_lag_meter_factory())
        self.shedder.start()  # Serve calls this on the loop the handlers run on
        # Its own handle rather than llm_handle (which binds LLMServer into the app), to
        # route on this replica's loop, which lives as long as the replica.
        self.client = Client(
            llm_handle.app_name, route_on_caller_loop=True, max_group_size=submit_group_size
        )

    def _refuse(self, request: Request, needs_key: bool = True) -> JSONResponse | None:
        """The error response for headers over MAX_HEADER_BYTES or (needs_key) a missing
        or wrong api key; None when the request may go on."""
        size = sum(len(name) + len(value) for name, value in request.scope["headers"])
        if size > MAX_HEADER_BYTES:
            message = f"headers: {size} bytes exceeds the limit of {MAX_HEADER_BYTES}"
            return _error(431, message, "invalid_request_error", {"Connection": "close"})
        if self.api_key is None or not needs_key:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        right_key = hmac.compare_digest(key.strip().encode(), self.api_key)
        if scheme.lower() != "bearer" or not right_key:
            return _unauthorized()
        return None

    def _shed(self) -> JSONResponse | None:
        """The 503 for a new completion while this replica's loop runs late; counted
        beside admission's refusals (/metrics)."""
        overloaded = self.shedder.check()
        if overloaded is None:
            return None
        self.client.caller_metrics.ingress_shed += 1
        return _error_response(overloaded)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.model_path):
            raise ValueError(f"model: {model!r} is not served here (serving {self.model_name!r})")

    @api.get("/health")
    async def health(self, request: Request) -> Any:
        if (refused := self._refuse(request, needs_key=False)) is not None:
            return refused
        # One stats call to every replica: cheap, and answered only by a replica whose
        # engine is up.
        try:
            num_ready = len(await self.client.stats_async())
        except Exception as exc:
            return _error(503, f"replicas not reachable: {exc!r}", "unavailable")
        if num_ready < self.num_replicas:
            message = f"{num_ready} of {self.num_replicas} replicas ready"
            return _error(503, message, "unavailable")
        return {"status": "ok"}

    @api.get("/version")
    async def version(self, request: Request) -> Any:
        if (refused := self._refuse(request)) is not None:
            return refused
        return {"version": _kvfleet_version()}

    @api.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            info = await self.client.model_info_async()
        except Exception as exc:
            return _error_response(exc)
        card = {
            "id": self.model_name,
            "object": "model",
            "owned_by": "kvfleet",
            "root": self.model_path,
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @api.get("/stats")
    async def stats(self, request: Request) -> Any:
        if (refused := self._refuse(request)) is not None:
            return refused
        return {"replicas": [_public_stats(s) for s in await self.client.stats_async()]}

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text: every live replica's engine figures (the same whichever
        ingress replica answers) and this ingress replica's routing (cluster.metrics)."""
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            snapshots = await self.client.metrics_async()
        except Exception as exc:
            return _error(503, f"replicas not reachable: {exc!r}", "unavailable")
        ingress_id = serve.get_replica_context().replica_id.unique_id
        lag_s = self.shedder.loop_lag_s()
        caller = self.client.caller_metrics
        text = exposition(snapshots, caller, self.model_name, ingress_id, lag_s)
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Any:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            body = parse(TokenizeRequest, await _json_body(request, self.body_timeout_s))
            self._check_model(body.model)
            tokenizer = await self.client.tokenizer_async()
            if tokenizer is None:
                raise ValueError("prompt: the model has no tokenizer")
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("prompt: give exactly one of prompt or messages")
            if body.messages is not None:
                tokens = chat_prompt_ids(tokenizer, [m.template_dict() for m in body.messages])
            else:
                tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            info = await self.client.model_info_async()
        except Exception as exc:
            return _error_response(exc)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len}

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Any:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            body = parse(DetokenizeRequest, await _json_body(request, self.body_timeout_s))
            self._check_model(body.model)
            tokenizer = await self.client.tokenizer_async()
            if tokenizer is None:
                raise ValueError("tokens: the model has no tokenizer")
            vocab_size = (await self.client.model_info_async()).vocab_size
            for i, token in enumerate(body.tokens):
                if not 0 <= token < vocab_size:
                    raise ValueError(f"tokens[{i}] = {token} is outside [0, {vocab_size})")
            return {"prompt": tokenizer.decode(body.tokens)}
        except Exception as exc:
            return _error_response(exc)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        if (refused := self._refuse(request) or self._shed()) is not None:
            return refused
        try:
            body = parse(CompletionRequest, await _json_body(request, self.body_timeout_s))
            self._check_model(body.model)
            body.check_supported()
            prompts = body.prompts()
            params = body.engine_params()
            tokenizer = await self.client.tokenizer_async()
            echoes = [Echo.of(body, p, tokenizer) for p in prompts] if body.echo else None
            if await request.is_disconnected():
                return _client_gone()
            if body.stream:
                chunks = await open_streams([self.client.stream(p, params) for p in prompts])
                events = self._completion_events(body, chunks, tokenizer, echoes)
                response = StreamingResponse(events, media_type="text/event-stream")
            else:
                per_prompt = await gather_or_cancel(
                    [self.client.samples_async(p, params) for p in prompts]
                )
                result = self._completion(body, per_prompt, tokenizer, echoes)
                response = JSONResponse(result.model_dump())
        except Exception as exc:
            return _error_response(exc)
        return _with_ignored_fields(response, body.ignored_fields, "/v1/completions")

    def _completion(
        self,
        body: CompletionRequest,
        per_prompt: list[list[Completion]],
        tokenizer: Any,
        echoes: "list[Echo] | None",
    ) -> CompletionResponse:
        choices = []
        for i, samples in enumerate(per_prompt):
            for j, done in enumerate(best_of(samples, body.n)):
                echo = echoes[i] if echoes is not None else None
                choices.append(
                    CompletionChoice(
                        index=i * body.n + j,
                        text=(echo.text if echo else "") + (done.text or ""),
                        finish_reason=done.finish_reason,
                        token_ids=done.token_ids,
                        logprobs=choice_logprobs(body, tokenizer, echo, done.token_ids,
                                                  done.logprobs, done.prompt_logprobs),
                    )
                )  # fmt: skip
        usage = Usage.of(
            sum(len(samples[0].prompt_token_ids) for samples in per_prompt),
            sum(len(d.token_ids) for samples in per_prompt for d in samples),
        )
        request_id = per_prompt[0][0].request_id
        return CompletionResponse(
            id=f"cmpl-{request_id}", model=self.model_name, choices=choices, usage=usage
        )

    async def _completion_events(
        self,
        body: CompletionRequest,
        chunks: AsyncIterator[tuple[int, Chunk]],
        tokenizer: Any,
        echoes: "list[Echo] | None",
    ) -> AsyncIterator[str]:
        head = CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", model=self.model_name, choices=[])
        usage = UsageCounter()
        offsets: dict[int, int] = {}  # per choice: its text so far (and its echo sent)
        fast = None
        if body.logprobs is None and echoes is None and not body.continuous_usage:
            fast = CompletionChunks(head)  # the common chunk without a model (cluster.sse)
        try:
            async for i, chunk in chunks:
                index = i * body.n + chunk.index
                usage.add(index, chunk, i)
                if fast is not None:
                    text = chunk.text or ""
                    yield fast.event(index, text, chunk.finish_reason, chunk.token_ids)
                    continue
                echo = None
                if echoes is not None and index not in offsets:
                    echo = echoes[i]
                text = (echo.text if echo else "") + (chunk.text or "")
                logprobs = choice_logprobs(
                    body, tokenizer, echo, chunk.token_ids, chunk.logprobs,
                    chunk.prompt_logprobs, offsets.get(index, 0),
                )  # fmt: skip
                offsets[index] = offsets.get(index, 0) + len(text)
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    finish_reason=chunk.finish_reason,
                    token_ids=chunk.token_ids,
                    logprobs=logprobs,
                )
                yield _sse(
                    head.model_copy(
                        update={
                            "choices": [choice],
                            "usage": usage.of(index) if body.continuous_usage else None,
                        }
                    )
                )
            if body.include_usage:
                yield _sse(head.model_copy(update={"usage": usage.total()}))
        except Exception as exc:
            yield _error_event(exc)
        finally:
            await chunks.aclose()  # aborts the requests if the client disconnected
        yield DONE_EVENT

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        if (refused := self._refuse(request) or self._shed()) is not None:
            return refused
        try:
            body = parse(ChatCompletionRequest, await _json_body(request, self.body_timeout_s))
            self._check_model(body.model)
            body.check_supported()
            params = body.engine_params()
            prompt = await self.client.chat_prompt_async(body.chat_messages())
            tokenizer = await self.client.tokenizer_async()
            if await request.is_disconnected():
                return _client_gone()
            if body.stream:
                chunks = await open_streams([self.client.stream(prompt, params)])
                events = self._chat_events(body, chunks, tokenizer)
                response = StreamingResponse(events, media_type="text/event-stream")
            else:
                samples = await self.client.samples_async(prompt, params)
                choices = [
                    ChatChoice(
                        index=done.index,
                        message=ChatResponseMessage(content=done.text or ""),
                        finish_reason=done.finish_reason,
                        logprobs=None
                        if done.logprobs is None
                        else chat_logprobs(tokenizer, done.logprobs),
                    )  # fmt: skip
                    for done in samples
                ]
                result = ChatCompletionResponse(
                    id=f"chatcmpl-{samples[0].request_id}",
                    model=self.model_name,
                    choices=choices,
                    usage=Usage.of(
                        len(samples[0].prompt_token_ids), sum(len(d.token_ids) for d in samples)
                    ),
                )
                response = JSONResponse(result.model_dump())
        except Exception as exc:
            return _error_response(exc)
        return _with_ignored_fields(response, body.ignored_fields, "/v1/chat/completions")

    async def _chat_events(
        self, body: ChatCompletionRequest, chunks: AsyncIterator[tuple[int, Chunk]], tokenizer: Any
    ) -> AsyncIterator[str]:
        """Per choice the role delta, content deltas, a finish chunk; the usage chunk if
        asked."""
        head = ChatCompletionChunk(
            id=f"chatcmpl-{uuid.uuid4().hex}", model=self.model_name, choices=[]
        )
        usage = UsageCounter()
        fast = None if body.continuous_usage else ChatDeltas(head)  # cluster.sse

        def event(
            index: int,
            delta: ChatDelta,
            finish_reason: str | None = None,
            logprobs: ChatLogprobs | None = None,
        ) -> str:
            choice = ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs
            )
            continuous = usage.of(index) if body.continuous_usage else None
            return _sse(head.model_copy(update={"choices": [choice], "usage": continuous}))

        try:
            for index in range(body.n):
                yield event(index, ChatDelta(role="assistant", content=""))
            async for _, chunk in chunks:
                usage.add(chunk.index, chunk, 0)
                if chunk.text and chunk.logprobs is None and fast is not None:
                    yield fast.event(chunk.index, chunk.text)
                elif chunk.text or chunk.logprobs:
                    logprobs = None
                    if chunk.logprobs is not None:
                        logprobs = chat_logprobs(tokenizer, chunk.logprobs)
                    yield event(chunk.index, ChatDelta(content=chunk.text or ""), None, logprobs)
                if chunk.finish_reason is not None:
                    yield event(chunk.index, ChatDelta(), chunk.finish_reason)
            if body.include_usage:
                yield _sse(head.model_copy(update={"usage": usage.total()}))
        except Exception as exc:
            yield _error_event(exc)
        finally:
            await chunks.aclose()
        yield DONE_EVENT
