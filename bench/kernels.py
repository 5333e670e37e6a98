"""Kernel microbenchmarks: KV append and paged decode attention against the copy ceiling.

    python -m bench.kernels [--quick] [--kv-cache-dtype fp8] [--out results/kernels.json]
    python -m bench.kernels --prefill [--shapes gpt2,qwen3-0.6b]

The default run measures, on one CUDA GPU: device-to-device copy bandwidth (bytes
read + written / time, the ceiling); append_kv_slots vs append_kv_slots_ref for
B in 1..4096; paged decode attention for B in {1, 8, 64, 256} x context in
{128, 1024, 8192}: achieved bandwidth (K/V bytes read / time), its share of the
copy ceiling, the split-merge kernel's own time, and the torch reference as the
peer for small cases. --prefill times paged prefill attention as the engine
launches it (its work lists) at the prompt shapes of PREFILL_CASES, in causal
TFLOPS, against torch's scaled_dot_product_attention on the same prompts laid out
contiguously (its flash kernel: the peer).

Timing: N launches are captured back to back in one torch.cuda.CUDAGraph (compiled
and warmed before capture), the graph is replayed, each replay timed with CUDA
events; a launch's time is the median replay over N. Serving runs decode inside
CUDA graphs, and a timer around a Python call (triton's do_bench) measures the
host's launch instead (~20-40 us a Triton launch) wherever the GPU work is shorter.
Every graph rotates over copies of its inputs so that one graph's working set is
at least 4x the L2 (up to MAX_COPIES copies), so small cases are not timed from L2.
Every config is checked against its torch reference before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
import sys
from collections.abc import Callable

import torch

from bench.common import copy_bandwidth_gbps, machine_description, markdown_table, write_json
from kernels import reference as ref

DEVICE = "cuda"  # a module constant so a CPU smoke test can point the sweep elsewhere
BLOCK_SIZE = 16
MAX_COPIES = 256
GRAPH_LAUNCHES = 20  # at least this many launches per captured graph
GRAPH_REPS = 15


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None  # the caches' dtype; None: dtype (--kv-cache-dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def kv_row_bytes(self) -> int:  # one token's K (or V) for all kv heads, in the cache
        return self.num_kv_heads * self.head_dim * self.cache_dtype.itemsize


SHAPES = [
    Shape("gpt2", 12, 12, 64, torch.float16),
    Shape("qwen3-0.6b", 16, 8, 128, torch.bfloat16),
]


def fp8_kv(shape: Shape) -> Shape:
    """The shape with float8 e4m3 caches (EngineConfig.kv_cache_dtype="fp8")."""
    return dataclasses.replace(shape, name=f"{shape.name}+fp8kv", kv_dtype=ref.FP8_KV_DTYPE)


def print_now(*args: object) -> None:
    print(*args, flush=True)  # progress survives a timeout of the whole command


@functools.cache
def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)


def num_copies(bytes_per_copy: int) -> int:
    """Copies to rotate over so that their total is >= 4x the L2 (bounded by MAX_COPIES)."""
    return max(1, min(MAX_COPIES, -(-4 * l2_bytes() // max(1, bytes_per_copy))))


def graph_time_us(fns: list[Callable[[], object]]) -> float:
    """Median device time of one call, from CUDA-graph replays of the calls back to back.

    fns are equivalent calls on different input copies; the graph cycles through
    all of them (a multiple of len(fns) launches, >= GRAPH_LAUNCHES). Every fn is
    called once before capture, so compilation and allocator growth stay outside.
    """
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    num_launches = len(fns) * -(-GRAPH_LAUNCHES // len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_launches):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(GRAPH_REPS)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times_ms = [start.elapsed_time(end) for start, end in events]
    del graph
    return statistics.median(times_ms) * 1e3 / num_launches


def _paged_setup(shape: Shape, batch: int, blocks_per_seq: int, gen: torch.Generator):
    """Caches with one shuffled, disjoint block list per sequence (a fragmented pool)."""
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
    slot_mapping = torch.randperm(batch, generator=gen, device=DEVICE).to(torch.int32)
    return cache_shape, block_table, slot_mapping


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=DEVICE, dtype=dtype)


def _random_caches(cache_shape: tuple[int, ...], shape: Shape, gen: torch.Generator, copies: int):
    """copies (K, V) cache pairs of random values, stored as the shape's cache dtype."""

    def one() -> torch.Tensor:
        return ref.quantize_kv_ref(_randn(cache_shape, shape.dtype, gen), shape.cache_dtype)

    return [(one(), one()) for _ in range(copies)]


def bench_append(shape: Shape, batch: int) -> dict:
    from kernels.kv_append import append_kv_slots

    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    blocks_per_seq = 4
    cache_shape, block_table, slot_mapping = _paged_setup(shape, batch, blocks_per_seq, gen)
    kv_shape = (batch, shape.num_kv_heads, shape.head_dim)
    row_bytes = shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    moved_bytes = 2 * batch * (row_bytes + shape.kv_row_bytes)  # K and V: read, then written
    inputs = [
        (_randn(kv_shape, shape.dtype, gen), _randn(kv_shape, shape.dtype, gen))
        for _ in range(num_copies(2 * batch * row_bytes))
    ]
    positions = torch.randint(
        0, blocks_per_seq * BLOCK_SIZE, (batch,), generator=gen, device=DEVICE
    ).to(torch.int32)
    k_cache = torch.zeros(cache_shape, dtype=shape.cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k, v = inputs[0]
    append_kv_slots(k, v, k_cache, v_cache, block_table, slot_mapping, positions)
    ref.append_kv_slots_ref(k, v, k_ref, v_ref, block_table, slot_mapping, positions)
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in ((k_cache, k_ref), (v_cache, v_ref))]  # fmt: skip
    assert all(same), "append mismatch"
    tail = (k_cache, v_cache, block_table, slot_mapping, positions)
    triton_fns = [lambda k=k, v=v: append_kv_slots(k, v, *tail) for k, v in inputs]
    torch_fns = [lambda k=k, v=v: ref.append_kv_slots_ref(k, v, *tail) for k, v in inputs]
    triton_us, torch_us = graph_time_us(triton_fns), graph_time_us(torch_fns)
    return {
        "shape": shape.name, "B": batch, "triton_us": triton_us, "torch_us": torch_us,
        "speedup": torch_us / triton_us, "GB/s": moved_bytes / triton_us / 1e3,
    }  # fmt: skip


def _decode_inputs(shape: Shape, batch: int, context: int):
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 100003 + context)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    cache_shape, block_table, slot_mapping = _paged_setup(shape, batch, blocks_per_seq, gen)
    kv_bytes = 2 * batch * context * shape.kv_row_bytes
    caches = _random_caches(cache_shape, shape, gen, num_copies(kv_bytes))
    q = _randn((batch, shape.num_heads, shape.head_dim), shape.dtype, gen)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    rows = min(8, batch)  # rows are independent; the reference loops in Python
    expect = ref.paged_decode_attention_ref(
        q[:rows], *caches[0], block_table, slot_mapping[:rows], context_lens[:rows],
        shape.head_dim**-0.5,
    )  # fmt: skip
    return caches, block_table, slot_mapping, q, context_lens, kv_bytes, expect


def bench_decode(
    shape: Shape, batch: int, context: int, copy_gbps: float, peer: bool = False
) -> dict:
    """One decode config with the kernel's own launch choice, graph-timed; peer adds the
    torch reference's time."""
    from kernels.decode_attention import (
        choose_decode_launch,
        default_tiles,
        merge_splits,
        num_sms,
        paged_decode_attention,
    )

    caches, block_table, slot_mapping, q, context_lens, kv_bytes, expect = _decode_inputs(
        shape, batch, context
    )
    kv_fp8 = shape.cache_dtype == ref.FP8_KV_DTYPE
    splits = choose_decode_launch(
        batch, shape.num_kv_heads, shape.head_dim, context, num_sms(q.device), kv_fp8
    ).num_splits
    tiles = default_tiles(shape.head_dim, splits > 1, kv_fp8)
    scale = shape.head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    num_parts = batch * shape.num_heads * splits
    workspace = (
        torch.empty(num_parts * shape.head_dim, dtype=torch.float32, device=DEVICE),
        torch.empty(num_parts, dtype=torch.float32, device=DEVICE),
    )
    fns = [
        lambda c=c: paged_decode_attention(
            q, *c, block_table, slot_mapping, context_lens, scale, out=out,
            max_context_len=context, workspace=workspace,
        )
        for c in caches
    ]  # fmt: skip
    fns[0]()
    rows = expect.shape[0]
    torch.testing.assert_close(out[:rows].float(), expect.float(), atol=2e-2, rtol=2e-2)
    us = graph_time_us(fns)
    gbps = kv_bytes / us / 1e3
    row = {
        "shape": shape.name, "B": batch, "ctx": context, "splits": splits,
        "tile": f"{tiles.block_n}/{tiles.num_warps}w/{tiles.num_stages}s", "us": us,
        "GB/s": gbps, "%copy": 100 * gbps / copy_gbps,
    }  # fmt: skip
    if splits > 1:
        row["merge_us"] = graph_time_us([lambda: merge_splits(*workspace, out, splits)])
    if peer:
        # The reference reads lengths on the host (.tolist()): not graph-capturable, so
        # triton's do_bench times it, host launch included.
        import triton.testing

        args = (*caches[0], block_table, slot_mapping, context_lens, scale)
        ref_fn = lambda: ref.paged_decode_attention_ref(q, *args)  # noqa: E731
        row["torch_ref_us"] = 1e3 * triton.testing.do_bench(ref_fn, return_mode="median")
    return row


APPEND_BATCHES = [1, 4, 16, 64, 256, 1024, 4096]
DECODE_BATCHES = [1, 8, 64, 256]
CONTEXTS = [128, 1024, 8192]
QUICK_APPEND_BATCHES, QUICK_DECODE_BATCHES, QUICK_CONTEXTS = [1, 64, 1024], [1, 256], [1024, 8192]


def run_sweep(args: argparse.Namespace, copy_gbps: float) -> dict:
    append_batches = QUICK_APPEND_BATCHES if args.quick else APPEND_BATCHES
    decode_batches = QUICK_DECODE_BATCHES if args.quick else DECODE_BATCHES
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    append_rows = []
    for shape, batch in itertools.product(args.shapes, append_batches):
        append_rows.append(bench_append(shape, batch))
        print_now(f"append {shape.name} B={batch}: {append_rows[-1]['triton_us']:.1f} us")
    decode_rows = []
    for shape, batch, context in itertools.product(args.shapes, decode_batches, contexts):
        peer = batch <= 8 and context <= 1024
        decode_rows.append(bench_decode(shape, batch, context, copy_gbps, peer))
        r = decode_rows[-1]
        print_now(f"decode {shape.name} B={batch} ctx={context}: {r['us']:.1f} us "
                  f"{r['%copy']:.0f}% of copy")  # fmt: skip
    print_now(f"\n## Copy bandwidth: {copy_gbps:.0f} GB/s (read + written)\n")
    print_now("## KV append, graph-timed (append_kv_slots vs append_kv_slots_ref)\n")
    print_now(markdown_table(append_rows))
    print_now("\n## Paged decode attention, graph-timed (K/V bytes read / time)\n")
    columns = ["shape", "B", "ctx", "splits", "tile", "us", "GB/s", "%copy", "merge_us",
               "torch_ref_us"]  # fmt: skip
    print_now(markdown_table(decode_rows, columns))
    return {"append": append_rows, "decode": decode_rows}


PREFILL_DECODE_CONTEXT = 130
# (name, prompts, prompt tokens each, one-token decode rows, their context): a 256-prompt
# burst's steps (64 prompts of 128 alone, then with the running rows riding in the
# forward, EngineOptions.decode_in_prefill), a serving step (a 4K chunk beside 192 rows
# at 2K), and long prompts.
PREFILL_CASES = [
    ("64x128", 64, 128, 0, 0),
    ("64x128 + 192 rows", 64, 128, 192, PREFILL_DECODE_CONTEXT),
    ("8x512 + 192 rows at 2048", 8, 512, 192, 2048),
    ("8x1024", 8, 1024, 0, 0),
    ("4x2048", 4, 2048, 0, 0),
    ("1x8192", 1, 8192, 0, 0),
]


def _prefill_inputs(shape: Shape, case: tuple, block_q: int, short_q: int, long_q: int):
    """Packed queries, paged caches (fragmented pool, rotated copies), and the work lists."""
    import numpy as np

    from kernels.prefill_attention import prefill_work_capacity, prefill_work_list

    _, prompts, q_len, decodes, decode_ctx = case
    gen = torch.Generator(device=DEVICE).manual_seed(prompts * 1009 + q_len + decodes)
    q_lens = np.array([q_len] * prompts + [1] * decodes)
    contexts = np.array([q_len] * prompts + [decode_ctx] * decodes)
    num_seqs, num_tokens = len(q_lens), int(q_lens.sum())
    blocks_per_seq = -(-int(contexts.max()) // BLOCK_SIZE)
    cache_shape, block_table, slot_mapping = _paged_setup(shape, num_seqs, blocks_per_seq, gen)
    kv_bytes = 2 * int(contexts.sum()) * shape.kv_row_bytes
    caches = _random_caches(cache_shape, shape, gen, num_copies(kv_bytes))
    q = _randn((num_tokens, shape.num_heads, shape.head_dim), shape.dtype, gen)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    work = np.zeros((prefill_work_capacity(num_tokens, num_seqs, block_q), 2), np.int64)
    short = np.zeros((num_seqs if short_q else 0, 2), np.int64)
    long = np.zeros((prefill_work_capacity(num_tokens, num_seqs, long_q) if long_q else 0, 2),
                    np.int64)  # fmt: skip
    prefill_work_list(q_lens, block_q, work, short, short_q, context_lens=contexts,
                      long_out=long if long_q else None, long_q=long_q)  # fmt: skip
    visible_keys = prompts * q_len * (q_len + 1) / 2 + decodes * decode_ctx
    flops = 4 * shape.num_heads * shape.head_dim * visible_keys  # the two matmuls over them
    work, short, long = (torch.tensor(a, device=DEVICE) for a in (work, short, long))
    return caches, q, block_table, slot_mapping, cu, context_lens, work, short, long, flops


def bench_prefill(shape: Shape, case: tuple) -> dict:
    """One prefill case as the engine launches it (short entries for decode rows, the long
    list where the engine's rule takes a chunk), graph-timed, checked against the torch
    reference first."""
    from kernels.prefill_attention import (
        paged_prefill_attention,
        prefill_block_q,
        prefill_short_q,
        prefill_tiles,
    )

    heads = (shape.num_heads, shape.num_kv_heads)
    tiles = prefill_tiles(shape.head_dim, shape.cache_dtype)
    block_q = prefill_block_q(*heads, tiles.main.rows)
    short_q = prefill_short_q(*heads)
    long_q = prefill_block_q(*heads, tiles.long.rows) if _has_long_chunks(shape, case) else 0
    caches, q, table, slots, cu, ctx, work, short_work, long_work, flops = _prefill_inputs(
        shape, case, block_q, short_q, long_q
    )
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)

    def call(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return paged_prefill_attention(
            q, kc, vc, table, slots, cu, ctx, scale, out=out, work=work, short_work=short_work,
            long_work=long_work,
        )  # fmt: skip

    call(*caches[0])
    rows = min(len(slots), 4)  # sequences are independent; the reference loops in Python
    expect = ref.paged_prefill_attention_ref(
        q[: int(cu[rows])], *caches[0], table, slots[:rows], cu[: rows + 1], ctx[:rows], scale
    )
    torch.testing.assert_close(out[: int(cu[rows])], expect, atol=2e-2, rtol=2e-2)
    us = graph_time_us([lambda kc=kc, vc=vc: call(kc, vc) for kc, vc in caches])
    return {"shape": shape.name, "case": case[0], "us": us, "TFLOPS": flops / us / 1e6}


def bench_prefill_peer(shape: Shape, case: tuple) -> dict | None:
    """torch SDPA, causal, on the prompts as [prompts, heads, q_len, head_dim] (no pages)."""
    name, prompts, q_len, decodes, _ = case
    if decodes:
        return None  # ragged: SDPA has no packed form to compare with
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dims = (prompts, shape.num_heads, q_len, shape.head_dim)
    kv_dims = (prompts, shape.num_kv_heads, q_len, shape.head_dim)
    q = _randn(dims, shape.dtype, gen)
    bytes_kv = 2 * prompts * q_len * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    kvs = [(_randn(kv_dims, shape.dtype, gen), _randn(kv_dims, shape.dtype, gen))
           for _ in range(num_copies(bytes_kv))]  # fmt: skip
    group = shape.num_heads // shape.num_kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = [lambda k=k, v=v: sdpa(q, k, v, is_causal=True, enable_gqa=group > 1) for k, v in kvs]
    us = graph_time_us(fns)
    flops = 4 * shape.num_heads * shape.head_dim * prompts * q_len * (q_len + 1) / 2
    return {"sdpa_us": us, "sdpa_TFLOPS": flops / us / 1e6}


def _has_long_chunks(shape: Shape, case: tuple) -> bool:
    """Whether the case's prompts go on the long list: the shape has a long tile and the
    engine's rule (prefill_attention.long_chunks) takes them; decode rows never qualify."""
    import numpy as np

    from kernels.prefill_attention import long_chunks, prefill_short_q, prefill_tiles

    _, prompts, q_len, _, _ = case
    if not prompts or prefill_tiles(shape.head_dim, shape.cache_dtype).long is None:
        return False
    prompt = np.array([q_len])  # a whole prompt: its context is its length
    return bool(long_chunks(prompt, prompt, prefill_short_q(shape.num_heads, shape.num_kv_heads)))


def run_prefill(shapes: list[Shape]) -> list[dict]:
    rows = []
    for shape, case in itertools.product(shapes, PREFILL_CASES):
        rows.append(bench_prefill(shape, case) | (bench_prefill_peer(shape, case) or {}))
        print_now(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="reduced sweep")
    parser.add_argument(
        "--prefill", action="store_true", help="paged prefill attention against torch SDPA"
    )
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES), help="filter")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
        help="fp8: the caches hold float8 e4m3 (each shape's name gets +fp8kv)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    names = args.shapes.split(",")
    args.shapes = [s for s in SHAPES if s.name in names]
    if len(args.shapes) != len(names):
        raise SystemExit(f"--shapes: unknown name in {names}; known {[s.name for s in SHAPES]}")
    if args.kv_cache_dtype == "fp8":
        args.shapes = [fp8_kv(s) for s in args.shapes]

    from kernels.decode_attention import num_sms

    copy_gbps = copy_bandwidth_gbps(torch.device(DEVICE))
    sms = num_sms(torch.device(DEVICE))
    print_now(f"{machine_description()}: copy bandwidth {copy_gbps:.0f} GB/s, {sms} SMs, "
              f"L2 {l2_bytes() / 2**20:.0f} MiB")  # fmt: skip
    payload = {
        "benchmark": "kernels",
        "copy_gbps": copy_gbps,
        "num_sms": sms,
    }
    if args.prefill:
        rows = run_prefill(args.shapes)
        print_now("\n## Paged prefill attention, graph-timed (causal TFLOPS)\n")
        print_now(markdown_table(rows))
        payload["prefill"] = rows
    else:
        payload |= run_sweep(args, copy_gbps)
    payload["triton"] = __import__("triton").__version__
    write_json(args.out, payload)


if __name__ == "__main__":
    sys.exit(main())
