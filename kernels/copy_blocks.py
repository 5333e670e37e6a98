"""Triton block copy for copy-on-write: one launch for all layers, K and V."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # elements per program


@triton.jit
def _copy_blocks_kernel(
    kv_cache_ptr, src_ptr, dst_ptr,
    stride_kv,  # elements between consecutive (layer, K/V) planes
    stride_block,
    BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    e = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = e < BLOCK_ELEMS
    base = kv_cache_ptr + plane * stride_kv
    vals = tl.load(base + src * stride_block + e, mask=mask)
    tl.store(base + dst * stride_block + e, vals, mask=mask)


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [num_copies]
    dst: torch.Tensor,  # [num_copies]
) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer's K and V, in one launch.

    Grid (copies, layers * 2, chunks of a block). Each block is contiguous
    (block_size * num_kv_heads * head_dim elements). A dst block must not also
    be a src block of the same call: copies run concurrently.
    """
    num_layers, two, num_blocks = kv_cache.shape[:3]
    assert two == 2 and kv_cache.is_contiguous(), "kv_cache must be contiguous"
    num_copies = src.shape[0]
    if num_copies == 0:
        return
    if kv_cache.element_size() == 1:  # fp8 moves as bytes: no float conversion on the way
        kv_cache = kv_cache.view(torch.uint8)
    block_elems = kv_cache[0, 0, 0].numel()
    chunk = min(_CHUNK, triton.next_power_of_2(block_elems))
    grid = (num_copies, num_layers * 2, triton.cdiv(block_elems, chunk))
    _copy_blocks_kernel[grid](
        kv_cache, src, dst, kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_ELEMS=block_elems, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
