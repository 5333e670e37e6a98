"""An ingress replica dies under its clients (issue 48): behind Serve's HAProxy, with two
ingress replicas, ray.kill one while streams and non-streamed completions run on both.

What a client sees: a stream that the dead replica was writing ends in an error (HAProxy
aborts the client's connection in the middle of the chunked body; httpx raises
RemoteProtocolError "incomplete chunked read", and so does the openai package's stream,
which reads through httpx); a stream on the other replica completes with [DONE]. A
request the dead replica had not answered a byte of is retried on the other replica, by
HAProxy (cluster.app.HAPROXY_RETRY_ON) or, where HAProxy answers it with a 500 instead,
by the openai package, and completes. None ends silently: a 200 stream that stops
without [DONE] and without an error fails the test.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.cluster import fake_engine
from cluster import Client, ClusterConfig, build_app
from cluster.app import cluster_runs_haproxy
from tests.cluster.haproxy_env import (
    haproxy_env,
    ingress_server_stats,
    wait_for_ingress_replicas_up,
)
from tests.cluster.local_ray import free_port, init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP_NAME = "kvfleet-failover"
STEP_S = 0.05  # the fake engine's step: one token per request per step
MAX_TOKENS = 120  # ~6 s a request, so the kill lands in the middle of every one
NUM_STREAMS = 8  # half through httpx (checks [DONE] itself), half through openai
NUM_WHOLE = 4  # non-streamed completions: nothing answered until they end


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    import ray
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny", num_replicas=1, num_blocks=4096, max_num_seqs=64, device="cpu",
        http=True, ingress_replicas=2, app_name=APP_NAME,
    )  # fmt: skip
    with haproxy_env(config):
        init_local_ray(num_cpus=2)
        try:
            assert cluster_runs_haproxy()
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            engine = functools.partial(fake_engine, step_s=STEP_S)
            serve.run(build_app(config, engine_factory=engine), name=APP_NAME, route_prefix="/")
            wait_for_ingress_replicas_up(APP_NAME, 2)
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


class Outcome:
    """How one request ended: its tokens, whether it completed, the error it raised."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.completed = False
        self.error: BaseException | None = None
        self.num_errors = 0  # 5xx answers a retrying client saw before the last
        self.started = threading.Event()  # the first token arrived

    @property
    def silent(self) -> bool:
        return not self.completed and self.error is None


BODY = {"model": "gpt2-tiny", "prompt": [46, 329, 31], "max_tokens": MAX_TOKENS,
        "ignore_eos": True}  # fmt: skip


def stream_httpx(base_url: str, out: Outcome) -> None:
    try:
        with httpx.Client(base_url=base_url, timeout=60.0) as http:
            with http.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        out.completed = True
                    elif line.startswith("data: {"):
                        (choice,) = json.loads(line[len("data: ") :])["choices"]
                        out.num_tokens += len(choice["token_ids"])  # a step's, maybe several
                        out.started.set()
    except Exception as error:  # noqa: BLE001 (the outcome under test)
        out.error = error
    out.started.set()


def stream_openai(base_url: str, out: Outcome) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    try:
        finish = None
        fields = {k: v for k, v in BODY.items() if k != "ignore_eos"}
        extra = {"ignore_eos": True}
        for chunk in client.completions.create(**fields, stream=True, extra_body=extra):
            out.num_tokens += len(chunk.choices[0].model_extra["token_ids"])  # vLLM's field
            finish = chunk.choices[0].finish_reason or finish
            out.started.set()
        # openai's stream ends at [DONE], and also, silently, where the body ends: only
        # the finish_reason tells a completed stream.
        out.completed = finish == "length" and out.num_tokens == MAX_TOKENS
    except Exception as error:  # noqa: BLE001
        out.error = error
    finally:
        client.close()
    out.started.set()


def whole(base_url: str, out: Outcome) -> None:
    """A non-streamed completion through the openai package as users run it (max_retries
    2). HAProxy replays a request the dead replica never answered a byte of, but not every
    one: HAProxy 2.8 keeps a request for an L7 retry only when conditions of its own hold
    (the whole request buffered before any was forwarded, among others), and on the CPU
    box about half the runs had one such completion answered at once with Serve's 500. The
    openai package retries a 5xx, so the completion still completes; out.num_errors counts
    the 5xx answers it saw on the way."""

    def count(response: httpx.Response) -> None:
        out.num_errors += response.status_code >= 500

    http = httpx.Client(timeout=60.0, event_hooks={"response": [count]})
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", http_client=http)
    try:
        fields = {k: v for k, v in BODY.items() if k != "ignore_eos"}
        completion = client.completions.create(**fields, extra_body={"ignore_eos": True})
        (choice,) = completion.choices
        out.num_tokens = len(choice.model_extra["token_ids"])
        out.completed = out.num_tokens == MAX_TOKENS
        if not out.completed:
            out.error = AssertionError(f"{out.num_tokens} tokens: {completion}")
    except Exception as error:  # noqa: BLE001
        out.error = error
    finally:
        client.close()


def kill_busiest_ingress_replica() -> tuple[str, dict[str, int]]:
    """ray.kill the ingress replica holding the most client sessions; its id and every
    replica's sessions just before."""
    import ray

    sessions = {replica_id: n for replica_id, (n, _) in ingress_server_stats(APP_NAME).items()}
    assert len(sessions) == 2 and sum(sessions.values()) >= NUM_STREAMS, sessions
    busiest = max(sessions, key=sessions.__getitem__)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Ingress#{busiest}", namespace="serve")
    ray.kill(actor, no_restart=True)
    return busiest, sessions


def test_a_dying_ingress_replica_cuts_no_stream_silently(base_url: str) -> None:
    streams = [Outcome() for _ in range(NUM_STREAMS)]
    wholes = [Outcome() for _ in range(NUM_WHOLE)]
    threads = [
        threading.Thread(target=stream_httpx if i % 2 else stream_openai, args=(base_url, out))
        for i, out in enumerate(streams)
    ] + [threading.Thread(target=whole, args=(base_url, out)) for out in wholes]
    for thread in threads:
        thread.start()
    for out in streams:
        assert out.started.wait(60.0)
    time.sleep(10 * STEP_S)  # every request is on an ingress replica, none near its end
    start_s = time.monotonic()
    killed, sessions = kill_busiest_ingress_replica()
    for thread in threads:
        thread.join(60.0)
    elapsed_s = time.monotonic() - start_s
    report = [(o.num_tokens, o.completed, repr(o.error)[:120]) for o in streams + wholes]
    print(f"killed {killed} of {sessions}; all ended {elapsed_s:.1f} s later: {report}")
    assert not any(t.is_alive() for t in threads), report
    assert not [o for o in streams + wholes if o.silent], report
    cut = [o for o in streams if o.error is not None]
    # Every stream the dead replica carried was cut with an error: httpx's
    # RemoteProtocolError, or the openai package's APIConnectionError raised from
    # httpcore's.
    assert cut, report
    for out in cut:
        error = out.error
        if isinstance(error, openai.APIConnectionError):
            error = error.__cause__
        assert type(error).__name__ == "RemoteProtocolError", report
    assert all(o.completed for o in streams if o.error is None), report
    assert all(o.num_tokens == MAX_TOKENS for o in streams if o.completed), report
    # The dead replica's non-streamed completions had not answered a byte: retried on the
    # other replica, they completed (as did the other replica's own).
    assert len(cut) <= sessions[killed] <= len(cut) + NUM_WHOLE, sessions
    retried_by_client = sum(o.num_errors for o in wholes)
    print(f"non-streamed on the killed replica: {sessions[killed] - len(cut)} of {NUM_WHOLE}, "
          f"{retried_by_client} answered 500 and retried by the client")  # fmt: skip
    assert all(o.completed for o in wholes), report
    # New requests go to the live replica while Serve replaces the dead one.
    for _ in range(4):
        short = BODY | {"max_tokens": 4}
        assert httpx.post(f"{base_url}/v1/completions", json=short, timeout=60).status_code == 200
    # The dead replica's requests end on the LLM replica too.
    client = Client(APP_NAME)
    deadline_s = time.monotonic() + 30.0
    while (stats := client.stats()[0]).num_running:
        assert time.monotonic() < deadline_s, stats
        time.sleep(0.2)
