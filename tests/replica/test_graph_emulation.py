"""The graph path's host side on the CPU (LLMEngine's emulate_graphs_on_cpu).

CI has no GPU. With the emulation a CPU runner pads to the graphs' sizes and buckets,
replays an EagerGraph per decode, mixed, prefill and sampling graph, and samples with
kernels.sampling (Triton's interpreter): which graph a step replays, what it stages in
the step's copy and which rows it reads back run here as on the GPU. The gpu tests
check the same on the device, where the forwards are the Triton kernels.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from replica import SamplingParams
from replica.runner.eager_graph import EagerGraph
from tests.replica.test_engine_chaos import ENGINES, check_run, compared, drive, scenario
from tests.replica.test_engine_hf import (
    MAX_NEW,
    assert_matches_hf,
    hf_greedy,
    make_engine,
    random_prompts,
    run_staggered,
    sampling_graphs_on_and_off,
    save_checkpoint,
)

# Where CUDA is, Triton compiles for it and no longer interprets kernels.sampling over CPU
# tensors; there the gpu tests run the graph path itself.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs Triton's interpreter (a machine without CUDA)"
)

SIZES = {"max_num_seqs": 4, "mixed_prefill_tokens": 8}  # few graphs: sampling is interpreted
EMULATED = {"emulate_graphs_on_cpu": True}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def count_replays(engine) -> collections.Counter:
    """Replays per kind of graph from now on: decode, mixed, prefill, sampling."""
    runner, counts = engine.runner, collections.Counter()
    kinds = [("decode", runner.graphs), ("mixed", runner.mixed_graphs)]
    kinds += [("prefill", runner.prefill_graphs)]
    for kind, graphs in kinds:
        for graph, _ in graphs.values():
            _count(graph, kind, counts)
    for graph in runner.sampling_graphs.values():
        _count(graph, "sampling", counts)
    return counts


def _count(graph: EagerGraph, kind: str, counts: collections.Counter) -> None:
    assert isinstance(graph, EagerGraph)
    replay = graph.replay

    def counted():
        counts[kind] += 1
        replay()

    graph.replay = counted


def test_without_the_emulation_the_cpu_runs_no_graph(checkpoint):
    runner = make_engine(checkpoint[0], 16).runner
    assert not runner.use_cuda_graphs and not runner.graph_sizes and not runner.graphs
    assert not runner.prefill.padded and not runner.sampler.fused


def test_emulated_graphs_give_hfs_greedy_tokens(checkpoint):
    """Whole prompts, chunked ones over a small pool (preemption), and requests that join
    running ones (mixed graphs): every greedy token is transformers', through the graphs."""
    path, hf_model = checkpoint
    prompts = random_prompts(21, [1, 15, 16, 17, 45, 3, 30])
    engine = make_engine(path, 16, **EMULATED, **SIZES)
    runner = engine.runner
    assert runner.use_cuda_graphs and runner.graph_sizes == [1, 2, 4]
    assert runner.mixed_graph_sizes == [1, 2, 4, 8, 12] and runner.prefill.padded
    replays = count_replays(engine)
    assert_matches_hf(engine, hf_model, prompts)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    assert run_staggered(engine, prompts, params) == [
        hf_greedy(hf_model, p, MAX_NEW) for p in prompts
    ]
    assert replays["decode"] > 20 and replays["mixed"] > 0 and replays["prefill"] > 0
    assert replays["sampling"] == 0  # greedy: the forward graph's argmax
    small = make_engine(path, 16, num_blocks=6, max_num_batched_tokens=8, **EMULATED, **SIZES)
    assert_matches_hf(small, hf_model, prompts)
    assert small.stats().num_preempted_total > 0


def test_emulated_sampling_graphs_give_the_eager_launches_tokens(tmp_path, monkeypatch):
    """Seeded sampled requests (top-k, top-p, neither): a decode or mixed step samples in a
    sampling graph replayed after its forward's, with its parameters staged in the step's
    copy; without graphs, through sample_fused. The same tokens, every graph kind taken.
    One model: the sampling does not depend on it (and is slow in the interpreter)."""
    path, _ = save_checkpoint("gpt2", tmp_path)
    # generate() runs the first four together (top-k: kind (True, True)), then the rest:
    # top-p and temperature alone (False, True), then temperature alone (False, False).
    sampled = functools.partial(SamplingParams, temperature=0.9, ignore_eos=True)
    # 8 tokens, not 12, for the top-k rows (~0.6 s an interpreted step): the staggered run
    # still holds all four at once, and takes the same decode and mixed steps of theirs.
    params = [sampled(max_tokens=8, top_k=20, top_p=0.8 if i % 2 else 1.0, seed=50 + i)
              for i in range(4)]  # fmt: skip
    params.append(sampled(max_tokens=6, top_p=0.8, seed=54))
    params += [sampled(max_tokens=12, temperature=0.5 + 0.1 * i, seed=55 + i) for i in range(3)]
    kinds = sampling_graphs_on_and_off(
        path, "float32", params, monkeypatch, "cpu", **EMULATED, **SIZES
    )
    assert kinds == {(False, False), (False, True), (True, True)}


@pytest.mark.parametrize("case", range(len(ENGINES)))
def test_emulated_graphs_on_random_schedules(tmp_path, case):
    """test_engine_chaos's schedules (a pool that preempts, chunked prompts, aborts, stops,
    sampled rows beside greedy ones, requests joining running ones) with graphs on and
    off: the greedy tokens are transformers', the seeded ones the same both ways."""
    path, hf_model = save_checkpoint("gpt2", tmp_path)
    reqs = scenario(case, hf_model)
    runs = []
    for graphs in (True, False):
        config = {"mixed_prefill_tokens": 8} | ENGINES[case] | {"enable_cuda_graphs": graphs}
        engine = make_engine(path, **EMULATED, **config)
        if graphs:
            replays = count_replays(engine)
        runs.append(drive(engine, reqs, seed=case))
        check_run(runs[-1], reqs, hf_model)
    assert replays["sampling"] > 0 and replays["prefill"] > 0
    assert replays["mixed"] > 0 or config["mixed_prefill_tokens"] == 0
    assert runs[0].aborted == runs[1].aborted
    assert compared(runs[0], reqs) == compared(runs[1], reqs)
