"""Client: the Python handle on a running kvfleet app.

Every method has an async form (stream, generate_async, stats_async) that runs on the
caller's event loop, and sync forms (generate, stats) that run the async ones on a
private event-loop thread. One CallerTransport per event loop carries the tokens.

Retry and idempotency (Client.stream): a request whose replica dies (ReplicaDiedError)
before the caller has received any of its tokens is resubmitted through the router, up
to max_retries times, each time under a fresh wire request id ("<id>~<attempt>") after
aborting the failed attempt everywhere, so no replica can keep generating it and no
token of a failed attempt ever reaches the caller: the caller sees one attempt's tokens,
or none. Once tokens were received, a failure ends the request with the typed error
carrying them (ReplicaError.token_ids); it is never replayed, since sampling need not
reproduce what the caller has already seen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from cluster.errors import ReplicaDiedError, ReplicaError
from cluster.messages import MAX_GROUP_SIZE
from cluster.metrics import CallerMetrics, MetricsSnapshot
from cluster.transport import CallerTransport, DeltaStream, TokenDelta, broadcast
from replica.detokenizer import TextStream
from replica.models.loader import load_tokenizer
from replica.outputs import Logprobs
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
    # The text this delta adds when the model has a tokenizer (replica.detokenizer:
    # incremental, held back while it may still become a stop string).
    text: str | None = None
    replica_id: str = ""
    num_prompt_tokens: int = 0
    index: int = 0  # which of the request's n samples
    # One per token of token_ids when the request asked for logprobs (SamplingParams);
    # the prompt's (entry 0 None) on a sample's first chunk when it asked prompt_logprobs.
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None
    replica_id: str = ""
    index: int = 0  # which of the request's n samples
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' logprobs (best_of ranks samples by it)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


class _Sample:
    """One sample's progress within Client.stream: its tokens, text and stop strings."""

    def __init__(
        self, index: int, tokenizer: Any | None, prompt_ids: list[int], stop: tuple[str, ...]
    ) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = None if tokenizer is None else TextStream(tokenizer, prompt_ids, stop)

    def chunk(self, rid: str, item: TokenDelta, replica_id: str, num_prompt: int) -> Chunk:
        """The chunk of a delta: with a tokenizer, its text, held back while it may
        become a stop string, and cut at one (finish_reason "stop")."""
        token_ids, text, reason = item.token_ids, None, item.finish_reason
        if self.text is not None:
            delta = self.text.add(item.token_ids, item.finished)
            token_ids, text = token_ids[: delta.num_token_ids], delta.text
            reason = "stop" if delta.stopped else reason
        logprobs = None if item.logprobs is None else item.logprobs[: len(token_ids)]
        self.token_ids += token_ids
        return Chunk(
            rid, token_ids, reason, text, replica_id, num_prompt, self.index, logprobs,
            item.prompt_logprobs,
        )  # fmt: skip


async def _next_item(live: dict[int, DeltaStream]) -> tuple[int, TokenDelta | BaseException]:
    """(sample index, item) of the first of several samples' streams with something."""
    while True:
        for index, deltas in live.items():
            item = deltas.take()
            if item is not None:
                return index, item
        waits = [deltas.wait() for deltas in live.values()]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)


@dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int
    eos_token_id: int | None
    has_tokenizer: bool
    max_model_len: int | None = None


class Client:
    """Talks to the LLMServer deployment of app `app_name` (see cluster.transport).

    max_retries: resubmissions of a request whose replica died before it streamed a
    token; retry_backoff_s: the first delay between them (doubling). carrier_timeout_s:
    how long a carrier stream may stay silent (no step, no heartbeat) before its replica
    is declared lost. abort_timeout_s bounds how long an abort waits for replicas.
    route_on_caller_loop: Serve's request router for this client runs on each calling
    event loop instead of Serve's router thread (cheaper per call; see
    current_loop_handle); for callers whose loops live as long as they use the client.
    serve_grpc: requests and their token streams go over each replica's gRPC server
    (Serve's by-value handle path, `_by_reference=False`) instead of Ray actor calls:
    the TTFT Serve adds on an H200 host falls from 3.4-3.9 to 2.3-2.9 ms, and a gpt2
    replica's process spends a third less CPU per request (docs/design.md, "Serve's
    gRPC path"); False keeps Ray's actor-call path. max_group_size: requests made in one
    event-loop pass go to the replicas in Serve calls of up to this many, each placed by the
    router as one request (ClusterConfig.submit_group_size); 1, the default, places each
    request on its own.

    Cost per streamed token in the calling process is a few microseconds, a good part of
    it garbage collection walking the start-up heap (Ray, torch) when the per-chunk
    allocations trigger it: a process that streams a lot should gc.freeze() once it has
    started up, as the engine and bench.load's generators do.
    """

    def __init__(
        self,
        app_name: str = "kvfleet",
        handle: Any | None = None,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.1,
        carrier_timeout_s: float = 10.0,
        abort_timeout_s: float = 5.0,
        stats_timeout_s: float = 10.0,
        route_on_caller_loop: bool = False,
        serve_grpc: bool = True,
        max_group_size: int = 1,
    ) -> None:
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        for name, value in (
            ("retry_backoff_s", retry_backoff_s),
            ("carrier_timeout_s", carrier_timeout_s),
            ("abort_timeout_s", abort_timeout_s),
            ("stats_timeout_s", stats_timeout_s),
        ):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name, flag in (
            ("route_on_caller_loop", route_on_caller_loop),
            ("serve_grpc", serve_grpc),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if not isinstance(max_group_size, int) or not 1 <= max_group_size <= MAX_GROUP_SIZE:
            raise ValueError(
                f"max_group_size must be an integer in [1, {MAX_GROUP_SIZE}], "
                f"got {max_group_size!r}"
            )
        self.max_group_size = max_group_size
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.carrier_timeout_s = carrier_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.stats_timeout_s = stats_timeout_s
        self.num_retries = 0  # resubmissions after a replica died (all requests)
        self.app_name = app_name
        self.route_on_caller_loop = route_on_caller_loop
        self.serve_grpc = serve_grpc
        self._handle = handle  # None: made on first use (see _transport)
        self._transports: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CallerTransport]
        self._transports = weakref.WeakKeyDictionary()
        self._info: ModelInfo | None = None
        self._info_tasks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task]
        self._info_tasks = weakref.WeakKeyDictionary()
        self._tokenizer: Any | None = None
        # What this client routed and had refused (cluster.ingress's /metrics shows it).
        self.caller_metrics = CallerMetrics()
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    # --- async API -------------------------------------------------------------------

    async def stream(
        self,
        prompt: list[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Yield the request's tokens as they are produced: one chunk per engine step, or
        per wake-up of this iterator when it reads slower than steps come (a chunk then
        holds every token that arrived since the last one).

        Raises ValueError naming the field for bad input, OverloadedError when
        admission control refuses the request, ReplicaDiedError when its replica is
        lost after streaming tokens (or on every retry), ReplicaError when the replica
        fails otherwise; both carry the tokens streamed so far. Leaving the iteration
        early (break, cancel, disconnect) aborts the request and frees its blocks.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        prompt_ids = await self._encode(prompt, params)
        if params.max_tokens is None:  # the room left in the context (_encode checked it)
            room = (await self.model_info_async()).max_model_len
            if room is not None:
                params = dataclasses.replace(params, max_tokens=room - len(prompt_ids))
        rid = request_id or uuid.uuid4().hex
        transport = self._transport()
        samples = [_Sample(i, self._tokenizer, prompt_ids, params.stop) for i in range(params.n)]
        for attempt in range(self.max_retries + 1):
            wire_id = rid if attempt == 0 else f"{rid}~{attempt}"
            live: dict[int, DeltaStream] = {}  # sample index -> its stream, until it ends
            try:
                try:
                    replica_id, streams = await self._submit(transport, wire_id, prompt_ids, params)
                except ReplicaDiedError as exc:
                    transport.abort_soon(wire_id)
                    if attempt == self.max_retries:
                        raise exc.with_progress(rid, [], attempt + 1) from exc
                    self.num_retries += 1
                    await asyncio.sleep(self.retry_backoff_s * 2**attempt)
                    continue
                live = dict(enumerate(streams))
                # Samples over for the caller whose stream is still read: sample 0 ended by
                # a stop string while others run (aborting its id would end them all).
                ended: set[int] = set()
                while len(ended) < len(live):
                    if len(live) == 1:
                        # take()/wait() rather than `await deltas.get()`: one coroutine less
                        # per chunk, on the path every token of every request takes.
                        ((index, deltas),) = live.items()
                        item: TokenDelta | BaseException | None = deltas.take()
                        if item is None:
                            await deltas.wait()
                            continue
                    else:
                        index, item = await _next_item(live)
                    if isinstance(item, BaseException):
                        del live[index]  # the transport forgot it (and aborts it)
                        received = any(sample.token_ids for sample in samples)
                        retry = isinstance(item, ReplicaDiedError) and not received
                        if not retry or attempt == self.max_retries:
                            if isinstance(item, ReplicaError):
                                raise item.with_progress(rid, samples[index].token_ids, attempt + 1)
                            raise item
                        self.num_retries += 1
                        break
                    if index in ended:
                        if item.finished:
                            del live[index]
                            ended.discard(index)
                        continue
                    chunk = samples[index].chunk(rid, item, replica_id, len(prompt_ids))
                    if chunk.finish_reason is not None:
                        if item.finished:
                            del live[index]
                        elif index == 0 and len(live) > 1:
                            ended.add(index)
                        else:  # a stop string: abort it on its replica
                            await asyncio.shield(transport.abort(live.pop(index).request_id))
                    yield chunk
                else:
                    return  # the finally aborts what is left (an ended sample 0)
            finally:
                for deltas in live.values():  # left early, or failed: abort the rest
                    await asyncio.shield(transport.abort(deltas.request_id))
            await asyncio.sleep(self.retry_backoff_s * 2**attempt)

    async def generate_async(
        self, prompt: list[int] | str, params: SamplingParams | None = None
    ) -> Completion:
        """The whole completion of one sample (n > 1: samples_async)."""
        if isinstance(params, SamplingParams) and params.n > 1:
            raise ValueError(f"n: generate returns one completion; use samples for n={params.n}")
        return (await self.samples_async(prompt, params))[0]

    async def samples_async(
        self, prompt: list[int] | str, params: SamplingParams | None = None
    ) -> list[Completion]:
        """The n completions of one prompt (SamplingParams.n), in sample order: prefilled
        once on one replica, the samples forked from it."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams, got {type(params).__name__}")
        parts: list[list[Chunk]] = [[] for _ in range(params.n)]
        async for chunk in self.stream(prompt, params):
            parts[chunk.index].append(chunk)
        prompt_ids = await self._encode(prompt, params)
        return [_completion(prompt_ids, chunks, self._tokenizer is not None) for chunks in parts]

    async def chat_stream(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> AsyncIterator[Chunk]:
        """stream() of the prompt the model's chat template makes of messages
        ([{"role": ..., "content": ...}], a generation prompt added)."""
        async for chunk in self.stream(await self.chat_prompt_async(messages), params):
            yield chunk

    async def chat_async(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> Completion:
        return await self.generate_async(await self.chat_prompt_async(messages), params)

    async def chat_prompt_async(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of messages through the model's chat template; ValueError when
        the model has no tokenizer or no chat template."""
        return chat_prompt_ids(await self.tokenizer_async(), messages)

    async def tokenizer_async(self) -> Any | None:
        """The model's tokenizer (loaded here once), None for a model without one."""
        await self.model_info_async()
        return self._tokenizer

    async def stats_async(self) -> list[ReplicaStats]:
        """One ReplicaStats per live replica, fresh to within the stats period."""
        results = await self._from_every_replica("stats")
        return [ReplicaStats.from_msgpack(r) for r in results if isinstance(r, bytes)]

    async def serving_counters_async(self) -> list[dict[str, Any]]:
        """Per live replica, totals since it started (LLMServer.serving_counters): what
        load tests difference over a run to tell a replica's own CPU saturation."""
        return [
            r for r in await self._from_every_replica("serving_counters") if isinstance(r, dict)
        ]

    async def metrics_async(self) -> list[MetricsSnapshot]:
        """Per live replica, its gauges and engine totals (LLMServer.metrics_snapshot)."""
        results = await self._from_every_replica("metrics_snapshot")
        return [MetricsSnapshot.from_wire(r) for r in results if isinstance(r, dict)]

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
        return ModelInfo(**(await self._transport().handle.model_info.remote()))

    async def aclose(self) -> None:
        """Let go of this event loop's transport; with route_on_caller_loop, also shut
        down the router that runs on this loop (call it before the loop ends)."""
        transport = self._transports.pop(asyncio.get_running_loop(), None)
        if transport is not None and transport.handle is not self._handle:
            await transport.handle.shutdown_async()

    # --- sync API --------------------------------------------------------------------

    def samples(
        self, prompt: list[int] | str, params: SamplingParams | None = None
    ) -> list[Completion]:
        return self._run_sync(self.samples_async(prompt, params))

    def generate(self, prompt: list[int] | str, params: SamplingParams | None = None) -> Completion:
        return self._run_sync(self.generate_async(prompt, params))

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> Completion:
        return self._run_sync(self.chat_async(messages, params))

    def stats(self) -> list[ReplicaStats]:
        return self._run_sync(self.stats_async())

    def model_info(self) -> ModelInfo:
        return self._run_sync(self.model_info_async())

    def serving_counters(self) -> list[dict[str, Any]]:
        return self._run_sync(self.serving_counters_async())

    # --- internals -------------------------------------------------------------------

    async def _from_every_replica(self, method_name: str) -> list[Any]:
        """Each live replica's answer to method_name (within stats_timeout_s); a replica
        whose call failed gives its exception instead, which callers skip."""
        handle = self._transport().handle
        return await broadcast(handle, method_name, timeout_s=self.stats_timeout_s)

    def _transport(self) -> CallerTransport:
        loop = asyncio.get_running_loop()
        transport = self._transports.get(loop)
        if transport is None:
            handle = self._handle
            if handle is None and self.route_on_caller_loop:
                handle = current_loop_handle(self.app_name)
            elif handle is None:
                from ray import serve

                handle = self._handle = serve.get_deployment_handle(LLM_DEPLOYMENT, self.app_name)
            transport = CallerTransport(
                handle, self.carrier_timeout_s, self.abort_timeout_s, self.serve_grpc,
                max_group_size=self.max_group_size,
            )  # fmt: skip
            self._transports[loop] = transport
        return transport

    async def _submit(
        self,
        transport: CallerTransport,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> tuple[str, list[DeltaStream]]:
        from router.errors import OverloadedError

        try:
            replica_id, deltas = await transport.submit_samples(
                request_id, prompt_ids, params.to_dict()
            )
        except OverloadedError:
            self.caller_metrics.admissions_rejected += 1
            raise
        self.caller_metrics.routing_decisions[replica_id] += 1
        return replica_id, deltas

    async def _encode(self, prompt: list[int] | str, params: SamplingParams) -> list[int]:
        """Token ids of the prompt; checks here what the router needs to be right.

        Lengths are checked before routing because the router would otherwise take a
        prompt longer than any replica's cache for overload; the replica checks the
        rest (each id an int inside the vocabulary) and is the authority.
        """
        info = await self.model_info_async()  # loads the tokenizer once, when there is one
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ValueError("prompt: text prompts need a model with a tokenizer")
            prompt_ids = list(self._tokenizer.encode(prompt))
        elif isinstance(prompt, list | tuple):
            prompt_ids = list(prompt)
        else:
            raise ValueError(
                f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not prompt_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if params.stop and self._tokenizer is None:
            raise ValueError("stop: stop strings need a model with a tokenizer")
        max_len = info.max_model_len
        if max_len is not None and len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt_token_ids: {len(prompt_ids)} tokens leave no room under "
                f"max_model_len ({max_len})"
            )
        if (
            max_len is not None
            and params.max_tokens is not None
            and len(prompt_ids) + params.max_tokens > max_len
        ):
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({max_len})"
            )
        return prompt_ids

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._thread_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name="kvfleet-client", daemon=True
                ).start()
                self._thread_loop = loop
        return asyncio.run_coroutine_threadsafe(coro, self._thread_loop).result()


def _completion(prompt_ids: list[int], chunks: list[Chunk], has_text: bool) -> Completion:
    """A sample's chunks, in order, as one Completion."""
    last = chunks[-1]
    assert last.finish_reason is not None
    logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs]
    return Completion(
        last.request_id, prompt_ids, [t for c in chunks for t in c.token_ids],
        last.finish_reason, "".join(c.text or "" for c in chunks) if has_text else None,
        last.replica_id, last.index, logprobs if any(c.logprobs is not None for c in chunks)
        else None, chunks[0].prompt_logprobs,
    )  # fmt: skip


def chat_prompt_ids(tokenizer: Any | None, messages: list[dict[str, str]]) -> list[int]:
    """messages through the tokenizer's chat template, a generation prompt added."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a model with a tokenizer; this one has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat_template")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def current_loop_handle(app_name: str, deployment_name: str = LLM_DEPLOYMENT) -> Any:
    """A new handle on the app's deployment (LLMServer) whose Serve router runs on the
    running loop.

    Serve's default handle routes on a loop thread of its own, so every call crosses
    threads twice in the calling process, and that thread competes for the GIL.
    Routing on the calling loop cut the TTFT that Serve adds from 4.5 to 4.0 ms on
    the H200 host, and caller CPU per unary call from 2.3 to 1.8 ms on the CPU box
    (docs/design.md, "Routing on the caller's loop"). Not
    serve.get_deployment_handle's cached handle: this one belongs to the
    loop it was made on, so Client keeps one per loop, and the loop must keep running
    while it is in use (Client.aclose shuts its router down).
    """
    from ray.serve.handle import DeploymentHandle

    handle = DeploymentHandle(deployment_name, app_name)
    handle._init(_run_router_in_separate_loop=False)
    return handle
