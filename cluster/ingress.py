"""OpenAI-compatible HTTP ingress (Serve FastAPI integration) in front of LLMServer.

POST /v1/completions (prompt: string or token ids; stream: SSE), GET /v1/models,
/health, /stats. Bad input (malformed JSON, unknown or invalid fields) -> 400 naming
the field; a body over MAX_BODY_BYTES -> 413; OverloadedError -> 503 with Retry-After;
a replica failing mid-request -> 502 (or, once an SSE stream has started, an error
event before [DONE]); anything else -> 500. An SSE stream is one unit per request
anyway, so it carries one event per engine step per request. A client that disconnects
aborts its request (the stream is closed, which aborts it on its replica).
"""

# No `from __future__ import annotations` here: FastAPI reads the handler signatures
# (`request: Request`) at runtime, through Serve's class-based ingress wrapper. Every
# helper the handlers call is defined above the class: Serve pickles the wrapped class
# with the module globals that exist when it is decorated.

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
from cluster.errors import ReplicaError
from replica.sampling_params import SamplingParams
from router.errors import OverloadedError

api = FastAPI(title="kvfleet")

MAX_BODY_BYTES = 1 << 20

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids")
_OTHER_FIELDS = ("model", "prompt", "stream", "ignore_eos", "n", "user")


class BodyTooLargeError(ValueError):
    """The request body is over MAX_BODY_BYTES."""


def parse_completion_request(
    body: Any, model: str | None = None
) -> tuple[list[int] | str, SamplingParams, bool]:
    """(prompt, params, stream) from an OpenAI /v1/completions body; ValueError names the field.

    model: the served model's name; a body naming another one is refused.
    """
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    unknown = sorted(set(body) - set(_SAMPLING_FIELDS) - set(_OTHER_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(map(str, unknown))}")
    if body.get("model") is not None and model is not None and body["model"] != model:
        raise ValueError(f"model: {body['model']!r} is not served here (serving {model!r})")
    n = body.get("n", 1)
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise ValueError("n: only n=1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a batch of {len(prompt)}")
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


async def _read_body(request: Request) -> bytes:
    """The request body, refused (BodyTooLargeError) past MAX_BODY_BYTES without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLargeError(f"body: {declared} bytes exceeds the limit of {MAX_BODY_BYTES}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"body: exceeds the limit of {MAX_BODY_BYTES} bytes")
    return bytes(body)


@serve.deployment(name="Ingress", max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress:
    def __init__(self, llm_handle: Any, model: str) -> None:
        self.model = model
        # Its own handle rather than llm_handle (which binds LLMServer into the app), to
        # route on this replica's loop, which lives as long as the replica.
        self.client = Client(llm_handle.app_name, route_on_caller_loop=True)

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
            body = json.loads(await _read_body(request))
        except BodyTooLargeError as exc:
            return _error(413, str(exc), "invalid_request_error")
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return _error(400, "body: not valid JSON", "invalid_request_error")
        chunks: AsyncIterator[Chunk] | None = None
        try:
            prompt, params, stream = parse_completion_request(body, self.model)
            if stream:
                chunks = self.client.stream(prompt, params)
                first = await chunks.__anext__()  # surfaces bad input / overload as a status
                response = StreamingResponse(
                    self._sse(first, chunks), media_type="text/event-stream"
                )
                chunks = None  # the response owns it now
                return response
            done = await self.client.generate_async(prompt, params)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        except OverloadedError as exc:
            return _overloaded(exc)
        except ReplicaError as exc:
            return _error(502, str(exc), "replica_error")
        except Exception as exc:  # never a hang or a bare 500 page: a typed JSON error
            return _error(500, f"internal error: {exc!r}", "internal_error")
        finally:
            if chunks is not None:
                await chunks.aclose()
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
        except Exception as exc:
            error = {"error": {"message": f"internal error: {exc!r}", "type": "internal_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await chunks.aclose()  # aborts the request if the client disconnected
        yield "data: [DONE]\n\n"
