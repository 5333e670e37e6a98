"""CUDA graph capture for the model runner's forwards, and the sizes they are captured at.

A graph replays the kernels its capture launched on the same device memory, so a
forward captured once per shape serves every step of that shape: the inputs are
copied into the persistent buffers it reads, and its outputs are read where the
capture left them. On the CPU, with the runner's emulate_graphs_on_cpu (tests), a
graph is an EagerGraph (replica.runner.eager_graph).

Invariant: graphs whose outputs one step reads together never share a memory pool (the
decode and mixed graphs share one, since a step replays one of them; prefill graphs and
sampling graphs each have their own), and each kind's graphs are captured largest first.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from replica.runner.eager_graph import EagerGraph
from replica.runner.graph_sampling import GRAPH_KINDS

if TYPE_CHECKING:
    from replica.runner.forwards import Forwards
    from replica.runner.prefill_inputs import PrefillBucket


def graphs_on(device: torch.device, emulate_on_cpu: bool = False) -> bool:
    """Whether a model runner on device takes the graph path's shapes and samplers (and,
    with enable_cuda_graphs, its graphs): on CUDA, or on the CPU emulating it (tests)."""
    return device.type == "cuda" or emulate_on_cpu


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured decode sizes: 1, 2, 4, 8, then steps of 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def padded_size(sizes: Sequence[int], num_rows: int) -> int:
    """The least captured size that holds num_rows (sizes ascending; none: num_rows)."""
    if not sizes:
        return num_rows
    for size in sizes:
        if size >= num_rows:
            return size
    raise AssertionError(f"{num_rows} rows exceed the largest captured size {sizes[-1]}")


def capture_graph(
    fn: Callable[[], Any], device: torch.device, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph | EagerGraph, Any]:
    """fn captured in a graph on pool (None: a new pool), and what the capture returned.
    fn runs once before, outside the graph: Triton compiles on a first call, and the
    caching allocator's first allocations must not land in the capture. Off CUDA (tests
    only), an EagerGraph."""
    if device.type != "cuda":
        graph = EagerGraph(fn)
        return graph, graph.out
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def capture_shapes(
    shapes: Sequence[Hashable],
    forward: Callable[[Any], Any],
    device: torch.device,
    pool: Any = None,
) -> tuple[dict[Any, tuple[torch.cuda.CUDAGraph, Any]], Any]:
    """A graph of forward(shape) per shape, one pool for all: {shape: (graph, outputs)},
    and the pool. Largest first, so that the smaller ones reuse its memory."""
    graphs = {}
    for shape in reversed(shapes):
        graph, out = capture_graph(lambda shape=shape: forward(shape), device, pool)
        pool = graph.pool()
        graphs[shape] = (graph, out)
    # The first launch of a graph uploads it to the device (ms for a prefill graph):
    # do it now, not on the first step that needs the size.
    if device.type == "cuda":
        for graph, _ in graphs.values():
            graph.replay()
        torch.cuda.synchronize(device)
    return graphs, pool


def capture_sampling_graphs(
    forward_graphs: dict[bool, dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor]]]],
    sample_rows: Callable[[torch.Tensor, int, tuple[bool, bool]], None],
    device: torch.device,
) -> dict[tuple[bool, int, tuple[bool, bool]], Any]:
    """A graph per decode and mixed graph (forward_graphs[mixed]: {size: (graph, (logits,
    greedy))}) and kind of sampling (GRAPH_KINDS): sample_rows(logits, size, kind) over
    its logits, keyed (mixed, size, kind). Their own pool: one replays after a forward's
    graph."""
    graphs, pool = {}, None
    for mixed, forwards in forward_graphs.items():
        for (size, (_, (logits, _))), kind in itertools.product(forwards.items(), GRAPH_KINDS):
            sample = functools.partial(sample_rows, logits, size, kind)
            graph, _ = capture_graph(sample, device, pool)
            pool = graph.pool()
            graphs[mixed, size, kind] = graph
    return graphs


def capture_forward_graphs(
    forwards: Forwards,
    graph_sizes: list[int],
    mixed_graph_sizes: list[int],
    prefill_buckets: list[PrefillBucket],
    sampling: bool,
    device: torch.device,
) -> tuple[dict, dict, dict, dict]:
    """Decode and mixed graphs per row count, prefill graphs per PrefillBucket, and (if
    sampling) the sampling graphs over the decode and mixed ones' logits (their own pool:
    one replays after a forward's graph), as capture_shapes' and capture_sampling_graphs'
    dicts: (decode, mixed, prefill, sampling). The inputs the forwards read must be
    uploaded (padding rows point at the null row and block).

    Two pools, because a step may replay a prefill graph and then a decode graph
    and sample from both outputs: graphs that share a pool share output memory.
    A step replays a decode or a mixed graph, never both: those share one.
    """
    mixed_forward = functools.partial(forwards.decode, append_first=True)
    mixed_graphs, sampling_graphs = {}, {}
    with torch.inference_mode():
        graphs, pool = capture_shapes(graph_sizes, forwards.decode, device)
        if mixed_graph_sizes:
            mixed_graphs, _ = capture_shapes(mixed_graph_sizes, mixed_forward, device, pool)
        prefill_graphs, _ = capture_shapes(prefill_buckets, forwards.prefill, device)
        if sampling:
            forward_graphs = {False: graphs, True: mixed_graphs}
            sampling_graphs = capture_sampling_graphs(forward_graphs, forwards.sample_rows, device)
    return graphs, mixed_graphs, prefill_graphs, sampling_graphs
