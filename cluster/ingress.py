"""OpenAI-compatible HTTP ingress (Serve FastAPI integration) in front of LLMServer.

POST /v1/completions (prompt: string or token ids; stream: SSE), GET /v1/models,
/health, /stats. Bad input -> 400 naming the field; OverloadedError -> 503 with
Retry-After; a replica failing mid-request -> 502. An SSE stream is one unit per
request anyway, so it carries one event per engine step per request.
"""

# No `from __future__ import annotations` here: FastAPI reads the handler signatures
# (`request: Request`) at runtime, through Serve's class-based ingress wrapper.

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from cluster.client import Chunk, Client
from cluster.transport import ReplicaError
from replica.sampling_params import SamplingParams
from router.errors import OverloadedError

api = FastAPI(title="kvfleet")

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids")
_OTHER_FIELDS = ("model", "prompt", "stream", "ignore_eos", "n", "user")


def parse_completion_request(body: Any) -> tuple[list[int] | str, SamplingParams, bool]:
    """(prompt, params, stream) from an OpenAI /v1/completions body; ValueError names the field."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    unknown = sorted(set(body) - set(_SAMPLING_FIELDS) - set(_OTHER_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    if body.get("n", 1) != 1:
        raise ValueError("n: only n=1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # OpenAI's batch-of-one form
    if not isinstance(prompt, str | list):
        raise ValueError("prompt: must be a string or a list of token ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream: must be a bool, got {stream!r}")
    sampling = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    sampling["ignore_eos"] = body.get("ignore_eos", False)
    if "temperature" not in sampling:
        sampling["temperature"] = 1.0
    return prompt, SamplingParams.from_dict(sampling), stream


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


def _overloaded(error: OverloadedError) -> JSONResponse:
    retry_after = str(max(1, math.ceil(error.retry_after_s)))
    return _error(503, str(error), "overloaded", {"Retry-After": retry_after})


@serve.deployment(name="Ingress", max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress:
    def __init__(self, llm_handle: Any, model: str) -> None:
        self.model = model
        self.client = Client(handle=llm_handle)

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "owned_by": "kvfleet"}],
        }

    @api.get("/stats")
    async def stats(self) -> dict:
        return {"replicas": [asdict(s) for s in await self.client.stats_async()]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body: not valid JSON", "invalid_request_error")
        try:
            prompt, params, stream = parse_completion_request(body)
            if stream:
                chunks = self.client.stream(prompt, params)
                first = await chunks.__anext__()  # surfaces bad input / overload as a status
                return StreamingResponse(self._sse(first, chunks), media_type="text/event-stream")
            done = await self.client.generate_async(prompt, params)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        except OverloadedError as exc:
            return _overloaded(exc)
        except ReplicaError as exc:
            return _error(502, str(exc), "replica_error")
        return {
            "id": f"cmpl-{done.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": done.text or "",
                    "token_ids": done.token_ids,
                    "finish_reason": done.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(done.prompt_token_ids),
                "completion_tokens": len(done.token_ids),
                "total_tokens": len(done.prompt_token_ids) + len(done.token_ids),
            },
        }

    async def _sse(self, first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        cmpl_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        chunk: Chunk | None = first
        try:
            while chunk is not None:
                event = {
                    "id": cmpl_id,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "text": chunk.text or "",
                            "token_ids": chunk.token_ids,
                            "finish_reason": chunk.finish_reason,
                            "logprobs": None,
                        }
                    ],
                }
                yield f"data: {json.dumps(event)}\n\n"
                chunk = await anext(chunks, None)
        except ReplicaError as exc:
            error = {"error": {"message": str(exc), "type": "replica_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await chunks.aclose()  # aborts the request if the client disconnected
        yield "data: [DONE]\n\n"
