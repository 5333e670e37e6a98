"""bench.load's offline peer: the same trace through a bare LLMEngine, measured the same way.

replay() drives the engine with add_request / step and stamps every token with
time.perf_counter, filling the RequestRecords that bench.load_metrics reads from the
generators: a closed loop of N users keeps N requests in the engine, each one that finishes
replaced by the next at once; an open loop adds each request at its arrival offset (the
engine steps between arrivals, and sleeps when it has nothing to run). A request's times
start when it is added, so TTFT includes its wait in the engine's queue, as a served
request's does.

run_offline_peer() runs it in a spawned process of its own, so the GPU memory it took
(CUDA context included) is all back before the replicas are deployed and size their KV
cache from free memory. It runs torch's ops on as many threads as a replica does (Ray sets
a replica's OMP_NUM_THREADS to its num_cpus): on a 2-core host a gpt2-tiny CPU engine at
torch's default of 2 threads made 37 output tokens/s against 224 at 1 (cluster.engine_loop
has why), which would compare the thread pools, not the paths.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.load_metrics import RequestRecord, compute_metrics
from bench.load_workload import RequestSpec
from replica import EngineConfig, LLMEngine, SamplingParams

OFFLINE_REPLICA_ID = "offline"


def _params(spec: RequestSpec) -> SamplingParams:
    # What a generator asks a replica for (bench.load_worker.send_one).
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


def replay(
    engine: LLMEngine, trace: list[RequestSpec], concurrency: int | None
) -> list[RequestRecord]:
    """Run the trace through the engine (closed loop of `concurrency` users, or open loop
    at the arrival offsets when None); one record per request, every token stamped."""
    records = {
        s.index: RequestRecord(s.index, len(s.prompt_token_ids), s.max_tokens, s.arrival_s)
        for s in trace
    }
    waiting = collections.deque(trace)
    sent_at: dict[str, float] = {}  # request id -> perf_counter when it was added
    t0 = time.perf_counter()

    def add(spec: RequestSpec) -> None:
        now = time.perf_counter()
        record = records[spec.index]
        record.scheduled_s = record.sent_s = now - t0
        try:
            engine.add_request(str(spec.index), spec.prompt_token_ids, _params(spec))
        except ValueError as exc:  # as a replica refuses it: a typed error, not lost
            record.outcome, record.error_type = "error", type(exc).__name__
            record.error_message, record.end_s = str(exc)[:300], now - t0
            return
        sent_at[str(spec.index)] = now

    def arrive() -> None:  # open loop: what has arrived; closed loop: a request per free user
        while waiting and (
            waiting[0].arrival_s <= time.perf_counter() - t0
            if concurrency is None
            else len(sent_at) < concurrency
        ):
            add(waiting.popleft())

    while True:
        arrive()
        if not engine.has_unfinished():
            if not waiting:
                break
            if concurrency is None:
                time.sleep(max(0.0, t0 + waiting[0].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for request_id in outputs.request_ids:  # one token a row
            record = records[int(request_id)]
            record.chunk_times_s.append(now - sent_at[request_id])
            record.chunk_num_tokens.append(1)
        for i, (reason, _, _) in outputs.finishes.items():
            request_id = outputs.request_ids[i]
            record = records[int(request_id)]
            record.outcome, record.finish_reason = "ok", reason
            record.end_s, record.replica_id = now - t0, OFFLINE_REPLICA_ID
            del sent_at[request_id]
    engine.check_invariants()
    return list(records.values())


def offline_run(
    config: EngineConfig, trace: list[RequestSpec], concurrency: int | None, num_threads: int
) -> dict:
    """Build the engine on num_threads torch threads, warm it up as a generator warms up a
    replica (one 2-token request, one new token: no KV block filled), replay the trace;
    metrics, records, block count."""
    torch.set_num_threads(num_threads)
    engine = LLMEngine(config)
    engine.generate([[1, 2]], SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    records = replay(engine, trace, concurrency)
    return {
        "path": "engine",
        "records": records,
        "metrics": compute_metrics(records, [s.index for s in trace]),
        "wall_s": round(time.perf_counter() - start, 3),
        "num_blocks": engine.cache_config.num_blocks,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
    }


def run_offline_peer(
    config: EngineConfig, trace: list[RequestSpec], concurrency: int | None, num_threads: int = 1
) -> dict:
    """offline_run in a spawned process (never forked: the caller is a Ray driver)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(offline_run, config, trace, concurrency, num_threads).result()
