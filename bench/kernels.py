"""Kernel microbenchmarks: KV append and paged decode attention against the copy ceiling.

    python -m bench.kernels --out results/kernels.json [--quick]

One run measures, on one CUDA GPU: device-to-device copy bandwidth (bytes read +
written / time, the ceiling); append_kv_slots latency vs append_kv_slots_ref;
paged decode attention achieved bandwidth (K/V bytes read / time) and its share
of the copy ceiling; the torch reference decode time for small cases as the peer.
Every config is checked against its torch reference once before it is timed.
Timing is triton.testing.do_bench (median; it flushes L2 before each call), and
each config rotates over several caches when they are small enough to sit in L2.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import copy_bandwidth_gbps, machine_description, markdown_table, write_json
from kernels import reference as ref

L2_BYTES = 64 * 2**20  # H200: 60 MiB; rotate caches so a config's working set exceeds it
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


SHAPES = [
    Shape("gpt2", 12, 12, 64, torch.float16),
    Shape("qwen3-0.6b", 16, 8, 128, torch.bfloat16),
]


def _time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return call


def _num_copies(bytes_per_copy: int) -> int:
    return max(1, min(8, -(-2 * L2_BYTES // max(1, bytes_per_copy))))


def _paged_setup(shape: Shape, batch: int, blocks_per_seq: int, gen: torch.Generator):
    """Caches with one shuffled, disjoint block list per sequence (a fragmented pool)."""
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
    slot_mapping = torch.randperm(batch, generator=gen, device="cuda").to(torch.int32)
    return cache_shape, block_table, slot_mapping


def bench_append(shape: Shape, batch: int) -> dict:
    from kernels.kv_append import append_kv_slots

    gen = torch.Generator(device="cuda").manual_seed(batch)
    blocks_per_seq = 4
    cache_shape, block_table, slot_mapping = _paged_setup(shape, batch, blocks_per_seq, gen)
    kv_shape = (batch, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(kv_shape, generator=gen, device="cuda").to(shape.dtype)
    v = torch.randn(kv_shape, generator=gen, device="cuda").to(shape.dtype)
    positions = torch.randint(
        0, blocks_per_seq * BLOCK_SIZE, (batch,), generator=gen, device="cuda"
    )
    positions = positions.to(torch.int32)
    k_cache = torch.zeros(cache_shape, dtype=shape.dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    append_kv_slots(k, v, k_cache, v_cache, block_table, slot_mapping, positions)
    ref.append_kv_slots_ref(k, v, k_ref, v_ref, block_table, slot_mapping, positions)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "append mismatch"
    args = (k, v, k_cache, v_cache, block_table, slot_mapping, positions)
    triton_us = _time_us(lambda: append_kv_slots(*args))
    torch_us = _time_us(lambda: ref.append_kv_slots_ref(*args))
    return {
        "shape": shape.name, "B": batch, "triton_us": triton_us, "torch_us": torch_us,
        "speedup": torch_us / triton_us,
    }  # fmt: skip


@functools.lru_cache(maxsize=1)  # the tuning sweep reuses one config's inputs
def _decode_inputs(shape: Shape, batch: int, context: int):
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    cache_shape, block_table, slot_mapping = _paged_setup(shape, batch, blocks_per_seq, gen)
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    caches = [
        tuple(
            torch.randn(cache_shape, generator=gen, device="cuda").to(shape.dtype) for _ in range(2)
        )
        for _ in range(_num_copies(kv_bytes))
    ]
    q_shape = (batch, shape.num_heads, shape.head_dim)
    q = torch.randn(q_shape, generator=gen, device="cuda").to(shape.dtype)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return caches, block_table, slot_mapping, q, context_lens, kv_bytes


def _check_decode(q, caches, block_table, slot_mapping, context_lens, scale, out) -> None:
    rows = min(8, q.shape[0])  # rows are independent; the reference loops in Python
    k_cache, v_cache = caches[0]
    expect = ref.paged_decode_attention_ref(
        q[:rows], k_cache, v_cache, block_table, slot_mapping[:rows], context_lens[:rows], scale
    )
    torch.testing.assert_close(out[:rows].float(), expect.float(), atol=2e-2, rtol=2e-2)


def bench_decode(
    shape: Shape, batch: int, context: int, copy_gbps: float, peer: bool, **tunables
) -> dict:
    from kernels.decode_attention import choose_num_splits, num_sms, paged_decode_attention

    caches, block_table, slot_mapping, q, context_lens, kv_bytes = _decode_inputs(
        shape, batch, context
    )
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)

    def run(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, block_table, slot_mapping, context_lens, scale, out=out,
            **tunables,
        )  # fmt: skip

    run(*caches[0])
    _check_decode(q, caches, block_table, slot_mapping, context_lens, scale, out)
    us = _time_us(_rotating([lambda c=c: run(*c) for c in caches]))
    gbps = kv_bytes / us / 1e3
    splits = choose_num_splits(batch, shape.num_kv_heads, context, num_sms(q.device))
    row = {
        "shape": shape.name, "B": batch, "ctx": context,
        "splits": tunables.get("num_splits") or splits, "us": us, "GB/s": gbps,
        "%copy": 100 * gbps / copy_gbps,
    }  # fmt: skip
    if tunables:
        row["tunables"] = str(tunables)
    if peer:
        k_cache, v_cache = caches[0]
        row["torch_ref_us"] = _time_us(
            lambda: ref.paged_decode_attention_ref(
                q, k_cache, v_cache, block_table, slot_mapping, context_lens, scale
            )
        )
    return row


def tune_decode(copy_gbps: float) -> list[dict]:
    """Launch-parameter sweep at the two targets: B=256 ctx=1024 and B=1 ctx=8192 (splits)."""
    tiles, warps = (32, 64, 128), (4, 8)
    sweeps = [
        ((256, 1024), [dict(block_n=n, num_warps=w, num_stages=st)
                       for n, w, st in itertools.product(tiles, warps, (2, 3))]),
        ((1, 8192), [dict(block_n=n, num_warps=w, num_splits=sp)
                     for n, w, sp in itertools.product(tiles, warps, (16, 32, 64))]),
    ]  # fmt: skip
    rows = []
    for shape, ((batch, context), configs) in itertools.product(SHAPES, sweeps):
        for tunables in configs:
            rows.append(bench_decode(shape, batch, context, copy_gbps, False, **tunables))
            print(f"tune {shape.name} B={batch} ctx={context} {tunables}: "
                  f"{rows[-1]['%copy']:.0f}% of copy")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="reduced sweep, no tuning")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")

    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    print(f"{machine_description()}: copy bandwidth {copy_gbps:.0f} GB/s")
    append_batches = [1, 64, 1024] if args.quick else [1, 4, 16, 64, 256, 1024, 4096]
    decode_batches = [1, 256] if args.quick else [1, 8, 64, 256]
    contexts = [1024, 8192] if args.quick else [128, 1024, 8192]

    append_rows = [bench_append(s, b) for s in SHAPES for b in append_batches]
    decode_rows = []
    for shape, batch, context in itertools.product(SHAPES, decode_batches, contexts):
        peer = batch <= 8 and context <= 1024
        decode_rows.append(bench_decode(shape, batch, context, copy_gbps, peer))
        print(f"decode {shape.name} B={batch} ctx={context}: {decode_rows[-1]['%copy']:.0f}%")
    tune_rows = [] if args.quick else tune_decode(copy_gbps)

    print(f"\n## Copy bandwidth: {copy_gbps:.0f} GB/s (read + written)\n")
    print("## KV append (append_kv_slots vs append_kv_slots_ref)\n")
    print(markdown_table(append_rows, ["shape", "B", "triton_us", "torch_us", "speedup"]))
    print("\n## Paged decode attention (K/V bytes read / time)\n")
    columns = ["shape", "B", "ctx", "splits", "us", "GB/s", "%copy", "torch_ref_us"]
    print(markdown_table(decode_rows, columns))
    if tune_rows:
        print("\n## Decode launch tuning\n")
        print(markdown_table(tune_rows, ["shape", "B", "ctx", "tunables", "us", "%copy"]))
    write_json(
        args.out,
        {
            "benchmark": "kernels", "copy_gbps": copy_gbps, "append": append_rows,
            "decode": decode_rows, "decode_tuning": tune_rows,
            "triton": __import__("triton").__version__,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
