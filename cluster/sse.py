"""The HTTP ingress's common server-sent events, written without pydantic.

Most events of a stream are the common chunk: new text and token ids, without logprobs,
echo or per-chunk usage. Those are written from the response's JSON prefix, computed
once per stream, and json.dumps of the text, not from a pydantic model per chunk: a
model_copy and model_dump_json cost 23 us an event against 3.3 us (CPU box), and one ingress
replica writes an event per engine step per stream (256 streams at ~1,000 steps/s on
one H200 gpt2 replica). The bytes differ from pydantic's only in how non-ASCII text is
escaped; both parse to the same object (tests/cluster/test_http_ingress.py).
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from cluster.openai_api import ChatCompletionChunk, CompletionResponse


def _opening(head: BaseModel) -> str:
    """head's JSON up to its choices: `data: {"id":...,"model":"m",` (choices and usage
    follow model in both response models, so the fields keep pydantic's order)."""
    return "data: " + head.model_dump_json(exclude={"choices", "usage"})[:-1] + ","


class CompletionChunks:
    """The common streamed completion chunk of one response: CompletionResponse `head`
    with one CompletionChoice (index, text, finish_reason, token_ids; no logprobs) and
    no usage."""

    def __init__(self, head: CompletionResponse) -> None:
        self.prefix = _opening(head) + '"choices":[{"index":'

    def event(
        self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None
    ) -> str:
        ids = "null" if token_ids is None else "[" + ",".join(map(str, token_ids)) + "]"
        finish = "null" if finish_reason is None else json.dumps(finish_reason)
        return (
            f'{self.prefix}{index},"text":{json.dumps(text)},"finish_reason":{finish},'
            f'"logprobs":null,"token_ids":{ids}}}],"usage":null}}\n\n'
        )


class ChatDeltas:
    """The common streamed chat chunk of one response: ChatCompletionChunk `head` with one
    content delta (no role, finish_reason or logprobs) and no usage."""

    def __init__(self, head: ChatCompletionChunk) -> None:
        self.prefix = _opening(head) + '"choices":[{"index":'

    def event(self, index: int, content: str) -> str:
        return (
            f'{self.prefix}{index},"delta":{{"role":null,"content":{json.dumps(content)}}},'
            '"finish_reason":null,"logprobs":null}],"usage":null}\n\n'
        )
