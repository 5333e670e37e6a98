"""ClusterConfig.engine_process: the replica's engine in a child process (cluster.engine_process).

The in-process tests drive LLMServer directly (no Ray); the last one runs a Serve app of
one gpt2-tiny replica whose engine is in a child process, against the offline engine.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from typing import Any

import pytest
import torch

from bench.cluster import FakeEngine, fake_engine
from cluster import Client, ClusterConfig, build_app
from cluster.deployment import LLMServer
from cluster.engine_loop import EngineUnavailableError
from cluster.engine_process import EngineProcess
from cluster.messages import (
    ERROR_FINISH,
    INVALID,
    UNAVAILABLE,
    CarrierBatch,
    StepBatch,
    SubmitAck,
    SubmitRequest,
    decode_message,
)
from replica import LLMEngine, SamplingParams
from replica.outputs import StepOutputs
from tests.cluster.local_ray import local_serve

pytestmark = pytest.mark.timeout(180)


class BrokenEngine(FakeEngine):
    """A FakeEngine whose 20th step raises, as an engine bug would."""

    def step(self) -> StepOutputs:
        self.num_steps = getattr(self, "num_steps", 0) + 1
        if self.num_steps == 20:
            raise RuntimeError("kernel exploded")
        return super().step()


def broken_engine(config: ClusterConfig, replica_id: str, num_gpus: float) -> BrokenEngine:
    return BrokenEngine(replica_id, 0.01)


def unloadable_engine(config: ClusterConfig, replica_id: str, num_gpus: float) -> Any:
    raise ValueError("no model directory at /nowhere")


def child_server(factory: Any) -> LLMServer:
    config = ClusterConfig(model="fake", device="cpu", stats_period_s=0.05, engine_process=True)
    return LLMServer(config, 0.0, factory, replica_id="r0", gil_switch_interval_s=None)


def wire(request_id: str, prompt: list[int], **params: Any) -> dict:
    return SubmitRequest(request_id, "c0", prompt, params).to_wire()


async def outcomes(server: LLMServer, requests: list[dict]) -> dict[str, tuple[list, Any]]:
    """Submit every request from one caller; (tokens, finish reason) per request id, or
    (None, the ack) for a refused one. The first request's stream carries the rest."""
    results: dict[str, Any] = {w["request_id"]: ([], None) for w in requests}

    async def one(w: dict) -> None:
        async for data in server.submit(w):
            message = decode_message(data)
            if isinstance(message, SubmitAck) and message.error is not None:
                results[w["request_id"]] = (None, message)
            elif isinstance(message, CarrierBatch):
                for step in message.steps:
                    for delta in step.deltas():
                        tokens, _ = results[delta.request_id]
                        results[delta.request_id] = (tokens + delta.token_ids, delta.finish_reason)

    first, *rest = requests
    carrier = asyncio.ensure_future(one(first))
    await asyncio.sleep(0.05)  # the first is admitted (and the carrier) before the rest
    await asyncio.gather(carrier, *(one(w) for w in rest))
    return results


def test_streams_every_request_and_refuses_bad_input() -> None:
    server = child_server(functools.partial(fake_engine, step_s=0.002))
    try:
        info = asyncio.run(server.model_info())
        assert info["vocab_size"] == 50257 and info["model"] == "fake"
        requests = [wire(f"q{i}", [1, 2, 3], max_tokens=5 + i, ignore_eos=True) for i in range(6)]
        requests.append(wire("empty", [], max_tokens=4))
        requests.append(wire("negative", [1], max_tokens=-1))
        results = asyncio.run(outcomes(server, requests))
        for i in range(6):  # FakeEngine's token k is k
            assert results[f"q{i}"] == (list(range(1, 6 + i)), "length")
        counters = asyncio.run(server.serving_counters())
        assert counters["submits"] == len(requests) and counters["messages"] >= 1
        assert counters["cpu_s"] > 0 and counters["engine_cpu_s"] > 0  # the child's, from /proc
        for name, field in (("empty", "prompt_token_ids"), ("negative", "max_tokens")):
            tokens, ack = results[name]
            assert tokens is None and ack.error_kind == INVALID and field in ack.error
        # the child's stats snapshots reach the parent
        before = server._engine_loop.stats.timestamp_s
        time.sleep(0.3)
        assert server._engine_loop.stats.timestamp_s > before
        assert asyncio.run(server.check_health()) is None
    finally:
        server.shutdown()
    assert server._engine_loop._proc.poll() == 0


@pytest.mark.parametrize("num_gpus,in_child", [(0.0, False), (1.0, True)])
def test_engine_process_default_follows_the_replicas_gpu(num_gpus: float, in_child: bool) -> None:
    """engine_process=None: a child process for a replica with a GPU, a thread otherwise
    (the factory here ignores the GPU count)."""
    config = ClusterConfig(model="fake", device="cpu", stats_period_s=0.05)
    assert config.engine_process is None
    factory = functools.partial(fake_engine, step_s=0.002)
    server = LLMServer(config, num_gpus, factory, replica_id="r0", gil_switch_interval_s=None)
    try:
        assert isinstance(server._engine_loop, EngineProcess) == in_child
        results = asyncio.run(outcomes(server, [wire("q", [1, 2], max_tokens=3, ignore_eos=True)]))
        assert results["q"] == ([1, 2, 3], "length")
    finally:
        server.shutdown()


def test_killed_child_ends_every_request_with_error_and_fails_health() -> None:
    server = child_server(functools.partial(fake_engine, step_s=0.02))

    async def scenario() -> dict:
        requests = [wire(f"q{i}", [1, 2], max_tokens=10_000, ignore_eos=True) for i in range(3)]
        running = asyncio.ensure_future(outcomes(server, requests))
        await asyncio.sleep(0.5)  # tokens are flowing
        server._engine_loop._proc.kill()
        return await asyncio.wait_for(running, 30)

    try:
        results = asyncio.run(scenario())
        for tokens, finish in results.values():
            assert tokens and finish == ERROR_FINISH
        with pytest.raises(RuntimeError, match="engine process exited"):
            asyncio.run(server.check_health())
        refused = asyncio.run(outcomes(server, [wire("late", [1], max_tokens=2)]))
        assert refused["late"][1].error_kind == UNAVAILABLE
    finally:
        server.shutdown()


def test_engine_failure_in_the_child_is_reported() -> None:
    server = child_server(broken_engine)
    try:
        requests = [wire(f"q{i}", [1, 2], max_tokens=100, ignore_eos=True) for i in range(2)]
        results = asyncio.run(outcomes(server, requests))
        assert {finish for _, finish in results.values()} == {ERROR_FINISH}
        with pytest.raises(RuntimeError, match="kernel exploded"):
            asyncio.run(server.check_health())
    finally:
        server.shutdown()
    assert server._engine_loop._proc.poll() is not None


def test_engine_that_cannot_start_raises_naming_why() -> None:
    with pytest.raises(RuntimeError, match="no model directory at /nowhere"):
        child_server(unloadable_engine)


def test_a_failing_delivery_ends_requests_with_error_and_stops_the_child() -> None:
    delivered: list[StepBatch] = []

    def deliver(caller_id: str, batch: StepBatch) -> None:
        if not delivered:
            delivered.append(StepBatch())  # the first delivery fails
            raise RuntimeError("bug in the replica's delivery")
        delivered.append(batch)

    config = ClusterConfig(model="fake", device="cpu", engine_process=True)
    factory = functools.partial(fake_engine, step_s=0.01)
    engine = EngineProcess(config, "r0", 0.0, factory, deliver)
    try:
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        engine.add("c0", "q0", [1, 2], params).result(timeout=30)
        assert engine._proc.wait(timeout=30) != 0  # killed
        deadline_s = time.monotonic() + 10
        while engine.is_alive and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert "bug in the replica's delivery" in engine.failure
        assert [d.finish_reason for d in delivered[-1].deltas()] == [ERROR_FINISH]
        with pytest.raises(EngineUnavailableError):
            engine.add("c0", "q1", [1], params).result(timeout=5)
    finally:
        engine.shutdown()


def test_unpicklable_engine_factory_is_named() -> None:
    with pytest.raises(ValueError, match="engine_factory must be picklable"):
        child_server(lambda *_: FakeEngine("r0"))


def test_child_exits_when_the_replica_is_gone() -> None:
    server = child_server(functools.partial(fake_engine, step_s=0.002))
    # What the replica process dying does to the pipe (a close() would wait for the
    # reader thread's blocked recv to let go of the socket).
    sock = socket.socket(fileno=server._engine_loop._conn.fileno())
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.detach()
    assert server._engine_loop._proc.wait(timeout=30) == 0


@pytest.mark.ray
def test_serve_app_with_engine_processes_equals_offline() -> None:
    from ray import serve

    config = ClusterConfig(
        model="gpt2-tiny",
        num_replicas=1,
        num_blocks=128,
        max_num_seqs=8,
        device="cpu",
        engine_process=True,
        app_name="kvfleet-engine-process",
    )
    prompts = [[464, 329, 318], [40, 88], list(range(1, 30))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(config.engine_config("offline", num_gpus=0))
    offline = engine.generate(prompts, params)
    with local_serve(num_cpus=4):
        serve.run(build_app(config), name=config.app_name, route_prefix=None)
        client = Client(config.app_name)

        async def burst() -> list:
            return await asyncio.gather(*(client.generate_async(p, params) for p in prompts * 3))

        for done, expected in zip(asyncio.run(burst()), offline * 3, strict=True):
            assert done.token_ids == expected.token_ids and done.finish_reason == "length"
        deadline_s = time.monotonic() + 10
        while (stats := client.stats()[0]).kv_usage or stats.num_running:
            assert time.monotonic() < deadline_s, stats  # the child's snapshots reach Serve
            time.sleep(0.05)
        info = client.model_info()
        assert (info.vocab_size, info.max_model_len) == (512, engine.max_model_len)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["gpt2", "qwen3-0.6b"])
def test_gpu_engine_process_equals_engine_thread(model: str) -> None:
    """The child builds the CUDA engine (graphs and all) from the replica's environment;
    greedy tokens through it equal the in-process engine's."""
    prompts = [[464, 329, 318], list(range(1, 200)), [7] * 17]
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    results = []
    for engine_process in (False, True):
        config = ClusterConfig(
            model=model, device="cuda", num_blocks=512, max_num_seqs=8,
            engine_process=engine_process,
        )  # fmt: skip
        server = LLMServer(config, 1.0, replica_id="r0", gil_switch_interval_s=None)
        try:
            requests = [wire(f"q{i}", p, **params) for i, p in enumerate(prompts)]
            results.append(asyncio.run(outcomes(server, requests)))
        finally:
            server.shutdown()
    thread, process = results
    assert all(finish == "length" and len(tokens) == 40 for tokens, finish in thread.values())
    assert process == thread
