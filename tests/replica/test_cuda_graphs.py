"""EagerGraph: the CPU's stand-in for a CUDA graph (replica.runner.eager_graph)."""

from __future__ import annotations

import types

import pytest
import torch

import replica.runner.eager_graph
from replica.runner.eager_graph import EagerGraph, StaleReadError


def make_state() -> types.SimpleNamespace:
    """A runner's persistent buffers: inputs the host copies into, state the graph writes."""
    return types.SimpleNamespace(
        inputs=torch.zeros(4, dtype=torch.int64),
        weight=torch.arange(8.0).reshape(4, 2),
        token_buf=torch.zeros(4, dtype=torch.int64),
    )


def forward(state: types.SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    rows = state.weight[state.inputs] * 2  # temporaries: made in the call
    greedy = rows.argmax(dim=1)
    state.token_buf.index_copy_(0, state.inputs, greedy + state.token_buf[state.inputs])
    return rows.sum(dim=1), greedy


def test_a_replay_reruns_into_the_first_calls_outputs() -> None:
    state = make_state()
    graph = EagerGraph(lambda: forward(state))
    sums, greedy = graph.out
    state.inputs.copy_(torch.tensor([3, 2, 1, 0]))  # a step copies into the captured buffer
    graph.replay()
    assert graph.out[0] is sums and graph.out[1] is greedy  # outputs never move
    assert sums.tolist() == [26.0, 18.0, 10.0, 2.0]
    assert greedy.tolist() == [1, 1, 1, 1]
    assert state.token_buf.tolist() == [2, 1, 1, 1]  # row 0 written by both calls, in place


def test_a_replay_may_read_what_its_capture_made() -> None:
    state = make_state()
    graph = EagerGraph(lambda: forward(state))
    state.inputs = graph.out[1]  # the graph's own output, read by the next replay
    graph.replay()
    graph.replay()


@pytest.mark.parametrize("rebound", ["inputs", "token_buf", "weight"])
def test_a_replay_that_reads_a_rebound_buffer_raises(rebound: str) -> None:
    state = make_state()
    graph = EagerGraph(lambda: forward(state))
    graph.replay()
    # A CUDA graph would go on reading (or writing) the captured tensor: the step's
    # inputs, or a buffer it writes, replaced by a new tensor go unseen.
    setattr(state, rebound, getattr(state, rebound).clone())
    with pytest.raises(StaleReadError, match="a replay read 1 tensor"):
        graph.replay()


def test_a_rebound_buffer_at_a_freed_temporarys_address_still_raises(monkeypatch) -> None:
    """The allocator may hand a new tensor the address of a temporary the capture made and
    freed (it did on the H200 host's torch): that address is no part of what a replay may
    read. The rebound buffer is given such an address here, whatever the allocator does."""
    buffers = [torch.zeros(4, dtype=torch.int64)]
    seen: set[int] = set()
    address = replica.runner.eager_graph._storage_address

    def spy(t: object) -> int:
        seen.add(address(t))
        return address(t)

    monkeypatch.setattr(replica.runner.eager_graph, "_storage_address", spy)
    graph = EagerGraph(lambda: (buffers[0] * 2 + 1).sum())
    temporaries = seen - {0, address(buffers[0]), address(graph.out)}
    assert temporaries  # the product and the sum's input, freed with the capture's return
    rebound = buffers[0] = buffers[0].clone()
    freed = min(temporaries)
    moved = lambda t: freed if t is rebound else address(t)  # noqa: E731
    monkeypatch.setattr(replica.runner.eager_graph, "_storage_address", moved)
    with pytest.raises(StaleReadError):
        graph.replay()
