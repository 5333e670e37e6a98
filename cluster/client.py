"""Client: the Python handle on a running kvfleet app.

Every method has an async form (stream, generate_async, stats_async) that runs on the
caller's event loop, and sync forms (generate, stats) that run the async ones on a
private event-loop thread. One CallerTransport per event loop carries the tokens.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from cluster.metrics import CallerMetrics
from cluster.transport import CallerTransport, SubmitRequest, TokenDelta
from replica.models.loader import load_tokenizer
from replica.sampling_params import SamplingParams
from replica.stats import ReplicaStats

LLM_DEPLOYMENT = "LLMServer"
T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    """New tokens of one streamed request (a delta)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None  # decoded delta when the model has a tokenizer
    replica_id: str = ""


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    replica_id: str = ""


@dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int
    eos_token_id: int | None
    has_tokenizer: bool


class Client:
    """Talks to the LLMServer deployment of app `app_name` (see cluster.transport)."""

    def __init__(self, app_name: str = "kvfleet", handle: Any | None = None) -> None:
        if handle is None:
            from ray import serve

            handle = serve.get_deployment_handle(LLM_DEPLOYMENT, app_name)
        self.app_name = app_name
        self._handle = handle
        self._transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CallerTransport]
        self._transports = weakref.WeakKeyDictionary()
        self._info: ModelInfo | None = None
        self._info_tasks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task]
        self._info_tasks = weakref.WeakKeyDictionary()
        self._tokenizer: Any | None = None
        self._metrics: CallerMetrics | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    # --- async API -------------------------------------------------------------------

    async def stream(
        self,
        prompt: list[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Yield the request's tokens as they are produced, one chunk per engine step.

        Raises ValueError naming the field for bad input, OverloadedError when
        admission control refuses the request, ReplicaError if its replica fails.
        Leaving the iteration early (break, cancel, disconnect) aborts the request.
        """
        prompt_ids = await self._encode(prompt)
        params = params or SamplingParams()
        rid = request_id or uuid.uuid4().hex
        transport = self._transport()
        request = SubmitRequest(rid, transport.caller_id, prompt_ids, params.to_dict())
        replica_id, queue = await self._submit(transport, request)
        finished = False
        try:
            while not finished:
                item: TokenDelta | BaseException = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield Chunk(rid, item.token_ids, item.finish_reason, self._decode(item), replica_id)
        finally:
            if not finished:
                await asyncio.shield(transport.abort(rid))

    async def generate_async(
        self, prompt: list[int] | str, params: SamplingParams | None = None
    ) -> Completion:
        prompt_ids = await self._encode(prompt)
        token_ids: list[int] = []
        last: Chunk | None = None
        async for chunk in self.stream(prompt_ids, params):
            token_ids.extend(chunk.token_ids)
            last = chunk
        assert last is not None and last.finish_reason is not None
        text = self._tokenizer.decode(token_ids) if self._tokenizer is not None else None
        return Completion(
            last.request_id, prompt_ids, token_ids, last.finish_reason, text, last.replica_id
        )

    async def stats_async(self) -> list[ReplicaStats]:
        """One ReplicaStats per live replica, fresh to within the stats period."""
        response = self._handle.broadcast("stats")
        results = await response.results_async(return_exceptions=True)
        return [ReplicaStats.from_msgpack(r) for r in results if isinstance(r, bytes)]

    async def model_info_async(self) -> ModelInfo:
        if self._info is None:
            # One fetch per event loop however many requests start at once.
            loop = asyncio.get_running_loop()
            task = self._info_tasks.get(loop)
            if task is None:
                task = self._info_tasks[loop] = loop.create_task(self._fetch_info())
            info = await task
            if self._info is None:
                if info.has_tokenizer:
                    self._tokenizer = load_tokenizer(info.model)
                self._info = info
        return self._info

    async def _fetch_info(self) -> ModelInfo:
        return ModelInfo(**(await self._handle.model_info.remote()))

    # --- sync API --------------------------------------------------------------------

    def generate(self, prompt: list[int] | str, params: SamplingParams | None = None) -> Completion:
        return self._run_sync(self.generate_async(prompt, params))

    def stats(self) -> list[ReplicaStats]:
        return self._run_sync(self.stats_async())

    def model_info(self) -> ModelInfo:
        return self._run_sync(self.model_info_async())

    # --- internals -------------------------------------------------------------------

    def _transport(self) -> CallerTransport:
        loop = asyncio.get_running_loop()
        transport = self._transports.get(loop)
        if transport is None:
            transport = self._transports[loop] = CallerTransport(self._handle)
        return transport

    async def _submit(self, transport: CallerTransport, request: SubmitRequest) -> tuple[str, Any]:
        from router.errors import OverloadedError

        if self._metrics is None:
            self._metrics = CallerMetrics()
        try:
            replica_id, queue = await transport.submit(request)
        except OverloadedError:
            self._metrics.admissions_rejected.inc()
            raise
        self._metrics.routing_decisions.inc(tags={"replica": replica_id})
        return replica_id, queue

    async def _encode(self, prompt: list[int] | str) -> list[int]:
        await self.model_info_async()  # loads the tokenizer once, when the model has one
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ValueError("prompt: text prompts need a model with a tokenizer")
            return list(self._tokenizer.encode(prompt))
        if not isinstance(prompt, list | tuple):
            raise ValueError(
                f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        return list(prompt)

    def _decode(self, delta: TokenDelta) -> str | None:
        if self._tokenizer is None or not delta.token_ids:
            return None
        return self._tokenizer.decode(delta.token_ids)

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._thread_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="kvfleet-client", daemon=True
                ).start()
                self._thread_loop = loop
        return asyncio.run_coroutine_threadsafe(coro, self._thread_loop).result()
