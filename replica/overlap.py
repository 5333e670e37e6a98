"""Two-batch overlap: a large decode step run as two halves on two CUDA streams.

At a few hundred rows a GPT-2-sized decode step is two kinds of kernel in turn:
paged attention, which streams the KV cache at near the memory bandwidth, and
the projections, which move little data and sit at a latency floor of a few
microseconds each on a fraction of the SMs. One after the other, the
projections' time adds to the step. Split in two halves of rows on two
streams, one half's projections can run while the other half's attention
streams the cache (SGLang's two-batch overlap does this across micro-batches).

The halves share nothing they write: each reads its own rows of the persistent
decode inputs, writes its own KV slots, and runs its split-K projections on its
own semaphores (kernels.linear.split_k_lane). The second half's attention of
layer l waits for the first half's attention of layer l (AttentionTurns), so
the two are offset by at least one sublayer rather than free to fall into
step and contend for the same resource at the same time.

Without streams (CPU) the halves run one after the other: the same rows and the
same arithmetic per row, so CPU tests check the split and the join.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.linear import split_k_lane

# Order the halves' attention launches (AttentionTurns); bench --overlap-unordered turns it
# off for A/B runs, before the engine starts.
ORDER_ATTENTION = True
# Decode attention programs per half (kernels.decode_attention's max_programs), so that one
# half's attention leaves SMs to the other half's projections; 0 leaves the grid whole.
ATTENTION_PROGRAMS = 0


class AttentionTurns:
    """Per-layer attention events of the leading half, waited on by the trailing half.

    The backend calls before() and after() around each decode attention launch, in
    layer order; a leader records event l after its layer-l attention, a follower
    waits on it before its own. The leader's forward must be enqueued first (an
    unrecorded event is no dependency), which DecodeHalves does.
    """

    def __init__(
        self,
        events: list[torch.cuda.Event] | None,
        follower: bool,
        attention_programs: int | None = None,
    ) -> None:
        self.events = events
        self.follower = follower
        self.attention_programs = attention_programs
        self.layer = 0

    def before(self) -> None:
        if self.follower and self.events is not None:
            torch.cuda.current_stream().wait_event(self.events[self.layer])

    def after(self) -> None:
        if not self.follower and self.events is not None:
            self.events[self.layer].record()
        self.layer += 1


class DecodeHalves:
    """Runs forward(rows, turns) for the two halves of a decode batch, overlapped on
    CUDA; returns their outputs concatenated along rows.

    forward(start, end, turns) runs rows [start, end) and returns [end - start, ...];
    shared: tensors made on the current stream that both halves read.
    """

    def __init__(self, device: torch.device, num_layers: int, ordered: bool) -> None:
        self.device = device
        self.num_layers = num_layers
        self.ordered = ordered
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(
        self,
        num_rows: int,
        forward: Callable[[int, int, AttentionTurns | None], torch.Tensor],
        shared: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        half = num_rows // 2
        if self.side is None:
            return torch.cat([forward(0, half, None), forward(half, num_rows, None)])
        events = [torch.cuda.Event() for _ in range(self.num_layers)] if self.ordered else None
        programs = ATTENTION_PROGRAMS or None
        turns = (AttentionTurns(events, False, programs), AttentionTurns(events, True, programs))
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)  # the side stream starts after what main holds so far
        for tensor in shared:
            tensor.record_stream(self.side)  # not reused before the side stream read it
        first = forward(0, half, turns[0])
        with torch.cuda.stream(self.side), split_k_lane(1):
            second = forward(half, num_rows, turns[1])
        main.wait_stream(self.side)
        second.record_stream(main)  # made on the side stream, read and freed on main
        return torch.cat([first, second])
