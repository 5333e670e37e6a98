"""The HTTP front door against hostile input, closed by default (issue 48).

One app with an api key, behind Serve's HAProxy (the default http_proxy): 401 without
it or with a wrong one (the official openai client included), /health open; /stats shows
no prefix hash; nested JSON, a slow body and huge headers get 400 / 408 / 431 (HAProxy's
own 400 for headers past its buffer); top_p far below float32's range samples the top
token; a client that disconnects mid-stream leaves no traceback in the ingress's log; a
prompt under two cache_salts hits no cached block, under the same one it does.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from cluster import Client, ClusterConfig, build_app
from cluster.app import cluster_runs_haproxy
from cluster.ingress import MAX_HEADER_BYTES, MAX_JSON_DEPTH
from replica.hashing import prefix_block_hashes, root_hash
from tests.cluster.haproxy_env import haproxy_env
from tests.cluster.local_ray import free_port, init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP_NAME = "kvfleet-front-door"
API_KEY = "sk-front-door-test"
BODY_TIMEOUT_S = 2.0
PREFIX_SALT = "front-door-salt"  # the default is a random one per app
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = list(range(300, 340))  # 40 tokens: 2 full blocks of 16, so 2 cached prefix hashes


@dataclass(frozen=True)
class App:
    client: Client
    port: int
    logs_dir: str  # this Ray session's Serve logs

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    import ray
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=1,
        num_blocks=64,
        max_num_seqs=8,
        max_model_len=256,
        device="cpu",
        http=True,
        api_key=API_KEY,
        http_body_timeout_s=BODY_TIMEOUT_S,
        prefix_salt=PREFIX_SALT,
        app_name=APP_NAME,
    )
    with haproxy_env(config):  # the default http_proxy, as `python -m cluster serve` runs it
        init_local_ray(num_cpus=2)
        port = free_port()
        try:
            assert cluster_runs_haproxy()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
            session_dir = ray._private.worker._global_node.get_session_dir_path()
            yield App(Client(APP_NAME), port, os.path.join(session_dir, "logs", "serve"))
        finally:
            serve.shutdown()
            ray.shutdown()


def _complete(http: httpx.Client, **fields: object) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True} | fields
    response = http.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_every_route_but_health_needs_the_key(app: App) -> None:
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        for method, route in [
            ("GET", "/v1/models"),
            ("GET", "/stats"),
            ("GET", "/metrics"),
            ("GET", "/version"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ]:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
                response = http.request(method, route, json={}, headers=headers)
                assert response.status_code == 401, (route, headers, response.text)
                assert "Authorization: Bearer" in response.json()["error"]["message"]
        assert http.get("/v1/models", headers=AUTH).status_code == 200

    right = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key=API_KEY, max_retries=0)
    done = right.completions.create(model="gpt2-tiny", prompt=[1, 2, 3], max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens == 4
    wrong = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="gpt2-tiny", prompt=[1, 2, 3], max_tokens=4)


def test_stats_shows_no_prefix_hash(app: App) -> None:
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        _complete(http, temperature=0)
        deadline_s = time.monotonic() + 10.0  # stats trail the engine by a stats period
        # The routing stats, inside the cluster, carry the hashes.
        while len((stats := app.client.stats()[0]).cached_prefix_hashes) < 2:
            assert time.monotonic() < deadline_s, stats
            time.sleep(0.05)
        response = http.get("/stats", headers=AUTH)
    assert response.status_code == 200
    (public,) = response.json()["replicas"]
    assert public["num_cached_prefix_hashes"] >= 2
    assert "cached_prefix_hashes" not in public
    for value in stats.cached_prefix_hashes:
        assert str(value) not in response.text


def _prefix_hit_tokens(app: App, after_s: float) -> int:
    """The replica's prefix_hit_tokens in a snapshot taken after after_s (time.time())."""
    deadline_s = time.monotonic() + 10.0
    while (stats := app.client.stats()[0]).timestamp_s <= after_s or stats.num_running:
        assert time.monotonic() < deadline_s, stats
        time.sleep(0.05)
    return stats.prefix_hit_tokens


def test_cache_salts_keep_prompts_apart_and_the_same_salt_hits(app: App) -> None:
    prompt = list(range(400, 440))  # 2 full blocks of 16, in no other test's prompt
    hits = [_prefix_hit_tokens(app, time.time())]
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        for route, salt in [
            ("/v1/completions", "tenant-a"),
            ("/v1/completions", "tenant-b"),
            ("/v1/completions", None),
            ("/v1/completions", "tenant-a"),
        ]:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            response = http.post(route, json=body, headers=AUTH)
            assert response.status_code == 200, response.text
            hits.append(_prefix_hit_tokens(app, time.time()))
        bad_body = {"prompt": prompt, "max_tokens": 2, "cache_salt": ""}
        bad = http.post("/v1/completions", json=bad_body, headers=AUTH)
    assert [b - a for a, b in zip(hits, hits[1:])] == [0, 0, 0, 32]
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
    # The replica publishes the chains the router computes (cluster.request_router) from
    # the deployment's salt and the request's: never the unsalted ones a client could.
    published = set(app.client.stats()[0].cached_prefix_hashes)
    for cache_salt in ("tenant-a", "tenant-b", None):
        chain = prefix_block_hashes(prompt, 16, root_hash(PREFIX_SALT, cache_salt))
        assert set(chain) <= published, cache_salt
    assert not set(prefix_block_hashes(prompt, 16)) & published


def _post(app: App, content: bytes) -> httpx.Response:
    headers = AUTH | {"content-type": "application/json"}
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        return http.post("/v1/completions", content=content, headers=headers)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 600, 2_000, 100_000])
def test_deeply_nested_json_is_400_naming_body(app: App, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    for body in (nested, b'{"prompt": [1, 2], "max_tokens": 4, "x": ' + nested + b"}"):
        response = _post(app, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == (
            f"body: nested deeper than {MAX_JSON_DEPTH} levels"
        )
    # Brackets inside strings are text, not nesting.
    text = json.dumps({"prompt": [1, 2], "max_tokens": 4, "x": "[{" * depth})
    assert _post(app, text.encode()).status_code == 200


def test_slow_body_is_cut_with_408(app: App) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", app.port), timeout=30) as sock:
        start_s = time.monotonic()
        sock.sendall(head.encode() + b'{"prompt":')  # 10 of the 1,000 bytes declared
        received = b""
        while part := sock.recv(65536):  # to the server's close
            received += part
        elapsed_s = time.monotonic() - start_s
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"body: not received within" in received
    assert BODY_TIMEOUT_S <= elapsed_s < BODY_TIMEOUT_S + 10, elapsed_s


def _ingress_replica_urls() -> list[str]:
    """The ingress replicas' own HTTP addresses, behind HAProxy: its config's servers."""
    import ray
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC

    folder, name = os.path.split(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC)
    path = os.path.join(folder, ray.get_runtime_context().get_node_id(), name)
    with open(path) as f:
        servers = [line.split() for line in f if line.strip().startswith("server SERVE_REPLICA_")]
    return [f"http://{words[2]}" for words in servers if "Ingress" in words[1]]


def test_huge_headers_are_refused(app: App) -> None:
    """HAProxy (the default http_proxy) answers headers over its 16 KB buffer 400 itself;
    the ingress's own bound (431 over MAX_HEADER_BYTES) holds behind Serve's proxy, and
    on an ingress replica's own port."""
    headers = AUTH | {"x-padding": "a" * (MAX_HEADER_BYTES + 1)}
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        response = http.get("/v1/models", headers=headers)
        assert response.status_code == 400, response.text
        assert http.get("/v1/models", headers=AUTH | {"x-padding": "a" * 8000}).status_code == 200
    (url, *_) = _ingress_replica_urls()
    with httpx.Client(base_url=url, timeout=60) as http:
        response = http.get("/v1/models", headers=headers)
        assert response.status_code == 431, response.text
        assert "headers" in response.json()["error"]["message"]
        assert http.get("/v1/models", headers=AUTH).status_code == 200


def test_top_p_below_float32_samples_the_top_token(app: App) -> None:
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        greedy = _complete(http, temperature=0, max_tokens=16)
        tiny = _complete(http, temperature=1.0, top_p=1e-46, seed=7, max_tokens=16)
    assert tiny != [0] * 16
    assert tiny == greedy  # only the most likely token is left to sample


def _ingress_log_text(app: App) -> str:
    text = ""
    for path in glob.glob(os.path.join(app.logs_dir, "replica_*Ingress*.log")):
        with open(path, errors="replace") as f:
            text += f.read()
    return text


def test_a_disconnect_mid_stream_logs_no_traceback(app: App) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    before = _ingress_log_text(app)
    for _ in range(3):
        with httpx.Client(base_url=app.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
            # Leaving both blocks closes the connection mid-stream.
    deadline_s = time.monotonic() + 10.0
    while (stats := app.client.stats()[0]).num_running:  # the aborts reached the engine
        assert time.monotonic() < deadline_s, stats
        time.sleep(0.1)
    time.sleep(1.0)  # the ingress's log lines of the cancellations
    added = _ingress_log_text(app)[len(before) :]
    assert "Traceback" not in added, added[-4000:]
    assert "CancelledError" not in added, added[-4000:]
