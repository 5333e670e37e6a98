"""kernels.linear's tiles: the Tile of a launch, and the table that picks one per shape.

The table is measured, not derived: each entry keeps the H200 figures that chose it
(the product alone against cuBLAS, or bench.engine's step), GPT-2's projections in fp16
and the Llama family's (qwen3-0.6b) in bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    """One launch's tiling: BLOCK_M x BLOCK_N output tiles stepping BLOCK_K through K,
    with its warps, pipeline stages and K slices."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # K slices, each its own program; the last to finish reduces

    def __str__(self) -> str:
        split = f"/k{self.split_k}" if self.split_k > 1 else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}/{self.num_warps}w/{self.num_stages}s"
            + split
        )


SMEM_BYTES = 227 * 1024  # the shared memory one program may take on an H100 / H200


def gated_tile(tile: Tile, elem_bytes: int) -> Tile:
    """The tile for a gated launch (activation "silu_mul") from the table's tile for the
    same [2I, K] weight: half its columns (at least 16), then the stages that fit.

    A gated program loads two W tiles per K step (gate and up) beside the x tile, so with
    half the columns it keeps the table tile's grid, accumulator registers and W bytes per
    stage. On an H200, qwen3-0.6b's gate_up in bf16, us at M = 1 / 16 / 64: the gated
    launch in this tile 6.72 / 7.16 / 6.61 against 6.60 / 7.38 / 6.40 for the plain
    gate_up launch, which a silu_and_mul launch then follows. The table is qwen3-0.6b's:
    other shapes were not swept gated.
    A stage takes elem_bytes * (BM * BK + 2 * BK * BN) of shared memory: at most
    SMEM_BYTES over that many stages (at least one, at most the tile's own), since
    64x64x128 in 5 stages of bf16 asked for 240 KiB and failed at start-up on an H200.
    Split K is kept: the gated launch's slices write both halves' partials.
    """
    block_n = max(16, tile.block_n // 2)
    stage_bytes = elem_bytes * (tile.block_m * tile.block_k + 2 * tile.block_k * block_n)
    num_stages = max(1, min(tile.num_stages, SMEM_BYTES // stage_bytes))
    return dataclasses.replace(tile, block_n=block_n, num_stages=num_stages)


MAX_ROWS = 256  # above this cuBLAS's large tiles have enough of them to fill the GPU


def choose_tile(
    num_rows: int, n: int, k: int, row_stats: bool = False, weight_is_kn: bool = True
) -> Tile | None:
    """The tile for an [num_rows, k] x [k, n] product, or None where cuBLAS is faster.
    row_stats: the launch is a linear_add, writing RowStats for a linear_norm.
    weight_is_kn False: an nn.Linear weight ([N, K], the Llama family), _nk_tile's table.

    Swept on an H200 over GPT-2's projections. Over M = 1..512, this table's tiles were
    within ~6% of the sweep's best; alone they match or beat cuBLAS up to M = 64 and trail
    it by up to 12% above (c_attn at M = 256: 6.5 against 5.8 us); fc + GELU wins at every
    M, cuBLAS needing a separate GELU kernel. In the engine they also join the launch
    overlap (kernels.pdl): the gpt2 decode step at 256 rows took 0.925 ms against 0.977
    with cuBLAS. At M = 64 and 256 with split K in the sweep: 8 warps / 5 stages took
    c_attn and fc at M = 64 from 5.3 / 5.8 us to 4.5 / 4.8, and attn.c_proj at M = 256
    from 5.0 to 4.2; mlp.c_proj (a long K over a narrow N) at M = 64 in 4 K slices took
    6.6 us against cuBLAS's 7.5. At M = 256 it is 8.6 us in 2 slices against cuBLAS's 7.9
    alone, yet the engine's step was 0.2-0.7% shorter with it (three paired runs): a
    Triton kernel keeps the launch overlap going. cuBLAS keeps every M > 256 (prefill). At
    the folded sublayer boundary: attn.c_proj as a linear_add at M = 256 in 64-column
    tiles (12 statistics tiles for the next launch to merge, not 24) took the boundary
    from 13.8 to 12.7 us; at M <= 128 the tiles here were within 0.1 us of the sweep's
    best. mlp.c_proj at M = 1 and 16 in 6 K slices of 16x32x64: 4.6 and 5.1 us against
    cuBLAS's 6.7 and 7.2 (the launch overlap: kernels.linear.overlap_mode).
    """
    if not weight_is_kn:
        return _nk_tile(num_rows, n, k)
    if num_rows > MAX_ROWS:
        return None
    if k > 2 * n:
        if num_rows <= 16:
            return Tile(16, 32, 64, 2, 4, split_k=6)
        if num_rows <= 64:
            return Tile(64, 64, 128, 4, 4, split_k=4)
        return Tile(64, 64, 128, 4, 5, split_k=2)
    if num_rows <= 16:
        return Tile(16, 32, 128, 4, 5)
    if num_rows <= 64:
        return Tile(64, 32, 128, 8, 5) if n >= 2048 else Tile(64, 32, 128, 4, 4)
    if n < 2048:
        return Tile(64, 64, 128, 4, 4) if row_stats and num_rows > 128 else Tile(64, 32, 128, 8, 5)
    if num_rows <= 128:
        return Tile(64, 64, 128, 4, 4)
    return Tile(64, 64, 64, 4, 5)


MAX_ROWS_NK = 64  # [N, K] weights: above this cuBLAS was as fast or faster


def _nk_tile(num_rows: int, n: int, k: int) -> Tile | None:
    """nn.Linear weights ([N, K]), swept on an H200 over qwen3-0.6b's projections in
    bf16 (M = 1, 16, 64, 256; best of the sweep against cuBLAS, us):

        M = 1   qkv 5.5 / 5.4, o_proj 4.8 / 13.2, gate_up 6.6 / 6.6, down 5.4 / 6.9
        M = 64  qkv 5.2 / 5.8, o_proj 6.2 / 6.1,  gate_up 6.4 / 6.7, down 7.0 / 7.6
        M = 256 qkv 8.1 / 7.1, o_proj 7.4 / 7.0,  gate_up 11.0 / 8.2, down 8.8 / 8.6

    At few rows every best tile splits K: one row's K loop is a chain of dependent
    loads, and the slices run it in parallel. Above 64 rows cuBLAS keeps the shape:
    with the M = 256 row's best tiles up to 256 rows (norms folded there too) the qwen3
    step was slower at 96, 128 and 256 rows (2.15 / 2.40 / 3.08 against 2.09 / 2.34 /
    2.99 ms, bench.engine, two alternating pairs).
    """
    if num_rows > MAX_ROWS_NK:
        return None
    if num_rows <= 16:
        if k >= 3 * n:  # down_proj
            return Tile(16, 32, 128, 2, 4, split_k=6)
        if k >= 2 * n:  # o_proj
            return Tile(16, 32, 64, 2, 5, split_k=6)
        return Tile(16, 64, 64, 4, 4, split_k=4)  # qkv, gate_up
    if k >= 2 * n:
        return Tile(64, 64, 128, 4, 4, split_k=4)
    return Tile(64, 64, 128, 4, 5) if n >= 6144 else Tile(64, 32, 128, 4, 5)
