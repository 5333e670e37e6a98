"""The engine requests behind one HTTP request (one per prompt of a list): started
together, failing together, their streams merged, their usage counted."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from cluster.client import Chunk
from cluster.openai_api import Usage

T = TypeVar("T")


def _new_task(job: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task outside the HTTP request's context: Serve's handle takes its request id
    from the context, and two calls under one id from one caller hang (one prompt of a
    list of two never got its answer)."""
    return asyncio.get_running_loop().create_task(job, context=contextvars.Context())


async def gather_or_cancel(jobs: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """All results, or the first failure with the other jobs cancelled (which aborts
    their requests)."""
    tasks = [_new_task(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_streams(
    streams: list[AsyncIterator[Chunk]],
) -> AsyncIterator[tuple[int, Chunk]]:
    """Each stream's first chunk awaited now, so bad input or overload is a status code
    rather than an error event; then an iterator over (prompt index, chunk) of all."""
    try:
        firsts = await gather_or_cancel([anext(s) for s in streams])
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    return merge(firsts, streams)


async def merge(
    firsts: list[Chunk], streams: list[AsyncIterator[Chunk]]
) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, chunk) from every stream as chunks come; closing it closes them all."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(streams) == 1:  # no task and queue for the common case
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Chunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        finally:
            await stream.aclose()

    tasks = [_new_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                remaining -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UsageCounter:
    """Prompt tokens per prompt and completion tokens per choice of a streamed response
    (a prompt's n choices count its tokens once, as OpenAI's usage does)."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}  # per prompt
        self.completion_tokens: dict[int, int] = {}  # per choice
        self.prompt_of: dict[int, int] = {}  # choice -> its prompt

    def add(self, index: int, chunk: Chunk, prompt: int) -> None:
        self.prompt_tokens[prompt] = chunk.num_prompt_tokens
        self.prompt_of[index] = prompt
        self.completion_tokens[index] = self.completion_tokens.get(index, 0) + len(chunk.token_ids)

    def of(self, index: int) -> Usage:
        prompt_tokens = self.prompt_tokens[self.prompt_of[index]]
        return Usage.of(prompt_tokens, self.completion_tokens[index])

    def total(self) -> Usage:
        return Usage.of(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))
