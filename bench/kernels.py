"""Kernel microbenchmarks: KV append and paged decode attention against the copy ceiling.

    python -m bench.kernels [--quick] [--out results/kernels.json]
    python -m bench.kernels --tune [--shapes gpt2,qwen3-0.6b] [--out results/tune.json]
    python -m bench.kernels --prefill [--tune] [--shapes gpt2,qwen3-0.6b]

The default run measures, on one CUDA GPU: device-to-device copy bandwidth (bytes
read + written / time, the ceiling); append_kv_slots vs append_kv_slots_ref for
B in 1..4096; paged decode attention for B in {1, 8, 64, 256} x context in
{128, 1024, 8192}: achieved bandwidth (K/V bytes read / time), its share of the
copy ceiling, the split-merge kernel's own time, and the torch reference as the
peer for small cases. --tune sweeps the decode launch parameters instead (see
tune_decode) and prints the values to put in kernels/decode_attention.py.
--prefill times paged prefill attention (the engine's work-list form) at the prompt
shapes of PREFILL_CASES, in causal TFLOPS, against torch's scaled_dot_product_attention
on the same prompts laid out contiguously (its flash kernel: the peer); with --tune it
sweeps the launch tiles and prints the best per case.

Timing. Primary ("us"): graph-timed. N launches are captured back to back in
one torch.cuda.CUDAGraph (compiled and warmed before capture), the graph is
replayed, each replay timed with CUDA events; a launch's time is the median
replay over N. Serving runs decode inside CUDA graphs, so this is the honest
number, and it keeps the Python launcher out of the window. Secondary
("do_bench_us"): triton.testing.do_bench, which flushes L2 but times from event
to event around a Python call: when the host launch (~20-40 us for a Triton
launch, two launches and two allocations for split decode) is slower than the
GPU work, it measures the host. That is why KV append read 33-37 us at every B
and B=1 decode ctx=1024 (3-4 MB, ~1 us of HBM traffic) read 27-74 us.
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


def do_bench_us(fns: list[Callable[[], object]]) -> float:
    """triton do_bench over the rotating calls (host launch included when host-bound)."""
    import triton.testing

    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    for fn in fns:
        fn()
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3


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


def bench_append(shape: Shape, batch: int, pdl: bool = True) -> dict:
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
    append_kv_slots(k, v, k_cache, v_cache, block_table, slot_mapping, positions, pdl=pdl)
    ref.append_kv_slots_ref(k, v, k_ref, v_ref, block_table, slot_mapping, positions)
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in ((k_cache, k_ref), (v_cache, v_ref))]  # fmt: skip
    assert all(same), "append mismatch"
    tail = (k_cache, v_cache, block_table, slot_mapping, positions)
    triton_fns = [lambda k=k, v=v: append_kv_slots(k, v, *tail, pdl=pdl) for k, v in inputs]
    torch_fns = [lambda k=k, v=v: ref.append_kv_slots_ref(k, v, *tail) for k, v in inputs]
    triton_us, torch_us = graph_time_us(triton_fns), graph_time_us(torch_fns)
    return {
        "shape": shape.name, "B": batch, "triton_us": triton_us, "torch_us": torch_us,
        "speedup": torch_us / triton_us, "GB/s": moved_bytes / triton_us / 1e3,
        "do_bench_us": do_bench_us(triton_fns),
    }  # fmt: skip


@functools.lru_cache(maxsize=1)  # the tuning sweep reuses one case's inputs and reference
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
    shape: Shape,
    batch: int,
    context: int,
    copy_gbps: float,
    peer: bool = False,
    do_bench: bool = False,
    **launch,
) -> dict:
    """One decode config, graph-timed; do_bench adds the do_bench time, peer the torch reference.

    launch: num_splits / block_n / num_warps / num_stages overrides of the defaults.
    """
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
    default = choose_decode_launch(
        batch, shape.num_kv_heads, shape.head_dim, context, num_sms(q.device), kv_fp8
    )
    splits = launch.get("num_splits") or default.num_splits
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
            max_context_len=context, workspace=workspace, **launch,
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
        "tile": _tile_name(launch, tiles), "us": us, "GB/s": gbps,
        "%copy": 100 * gbps / copy_gbps,
    }  # fmt: skip
    if splits > 1:
        pdl = launch.get("pdl", True)
        row["merge_us"] = graph_time_us([lambda: merge_splits(*workspace, out, splits, pdl=pdl)])
    if do_bench:
        row["do_bench_us"] = do_bench_us(fns)
    if peer:
        # The reference reads lengths on the host (.tolist()): not graph-capturable.
        args = (*caches[0], block_table, slot_mapping, context_lens, scale)
        row["torch_ref_us"] = do_bench_us([lambda: ref.paged_decode_attention_ref(q, *args)])
    return row


def _tile_name(launch: dict, tiles) -> str:
    """block_n/num_warps/num_stages as launched, e.g. '64/4w/2s'."""
    n = launch.get("block_n") or tiles.block_n
    w = launch.get("num_warps") or tiles.num_warps
    s = launch.get("num_stages") or tiles.num_stages
    return f"{n}/{w}w/{s}s"


APPEND_BATCHES = [1, 4, 16, 64, 256, 1024, 4096]
DECODE_BATCHES = [1, 8, 64, 256]
CONTEXTS = [128, 1024, 8192]
QUICK_APPEND_BATCHES, QUICK_DECODE_BATCHES, QUICK_CONTEXTS = [1, 64, 1024], [1, 256], [1024, 8192]
TUNE_CASES = [(1, 8192), (1, 1024), (8, 1024), (256, 1024)]  # (batch, context)
TUNE_PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
TUNE_BLOCK_N = (32, 64, 128)
TUNE_NUM_WARPS = (2, 4, 8)
TUNE_NUM_STAGES = (1, 2, 3)


def tune_tiles(head_dim: int) -> list[tuple[int, int, int]]:
    """(block_n, num_warps, num_stages) with 16..128 K-tile elements per thread."""
    return [
        (n, w, s)
        for n, w, s in itertools.product(TUNE_BLOCK_N, TUNE_NUM_WARPS, TUNE_NUM_STAGES)
        if 16 <= n * head_dim // (32 * w) <= 128
    ]


def tune_splits(shape: Shape, batch: int, context: int, sms: int) -> list[int]:
    """Split counts giving ~TUNE_PROGRAMS_PER_SM programs per SM (>= 32 tokens per split)."""
    base = batch * shape.num_kv_heads
    cap = min(128, max(1, context // 32))
    counts = {min(cap, max(1, -(-p * sms // base))) for p in TUNE_PROGRAMS_PER_SM}
    if batch >= 8:
        counts.add(1)
    return sorted(counts)


def tune_decode(
    copy_gbps: float, shapes: list[Shape], cases: list[tuple[int, int]] = TUNE_CASES
) -> list[dict]:
    """Sweep splits x (block_n, num_warps, num_stages) per case; print the best per case."""
    from kernels.decode_attention import num_sms

    sms = num_sms(torch.device(DEVICE))
    best_rows = []
    for shape, (batch, context) in itertools.product(shapes, cases):
        default = bench_decode(shape, batch, context, copy_gbps)
        rows = [default]
        for splits in tune_splits(shape, batch, context, sms):
            for n, w, s in tune_tiles(shape.head_dim):
                launch = dict(num_splits=splits, block_n=n, num_warps=w, num_stages=s)
                try:
                    rows.append(bench_decode(shape, batch, context, copy_gbps, **launch))
                except Exception as exc:  # a config that fails to compile or launch is skipped
                    print_now(f"  skip {launch}: {type(exc).__name__}: {exc}"[:200])
        best = min(rows, key=lambda r: r["us"])
        best_rows.append(best | {
            "default_splits": default["splits"], "default_tile": default["tile"],
            "default_us": default["us"], "default_%copy": default["%copy"],
            "programs_per_sm": best["splits"] * batch * shape.num_kv_heads / sms,
            "speedup_vs_default": default["us"] / best["us"],
        })  # fmt: skip
        top = sorted(rows, key=lambda r: r["us"])[:5]
        print_now(f"tune {shape.name} B={batch} ctx={context}: default "
                  f"{default['splits']} x {default['tile']} {default['us']:.1f} us "
                  f"({default['%copy']:.0f}%); best five:")  # fmt: skip
        for r in top:
            merge = f", merge {r['merge_us']:.1f} us" if "merge_us" in r else ""
            print_now(f"    splits={r['splits']} tile={r['tile']}: {r['us']:.1f} us "
                      f"({r['%copy']:.0f}% of copy{merge})")  # fmt: skip
    return best_rows


def print_tune_advice(best_rows: list[dict], shapes: list[Shape], sms: int) -> None:
    """The exact values for kernels/decode_attention.py, from the target cases."""
    print_now("\n## Values for kernels/decode_attention.py\n")
    by_case = {(r["shape"], r["B"], r["ctx"]): r for r in best_rows}
    for shape in shapes:
        for table, (batch, context) in (
            ("SPLIT_TILES", (1, 8192)),
            ("ONE_PASS_TILES", (256, 1024)),
        ):
            r = by_case.get((shape.name, batch, context))
            if r is None:
                continue
            n, w, s = (int(x.rstrip("ws")) for x in r["tile"].split("/"))
            print_now(f"{table}[{shape.head_dim}] = DecodeTiles(block_n={n}, num_warps={w}, "
                      f"num_stages={s})  # {shape.name} B={batch} ctx={context}: splits "
                      f"{r['splits']}, {r['us']:.1f} us, {r['%copy']:.0f}% of copy "
                      f"(default {r['default_us']:.1f} us, {r['default_%copy']:.0f}%)")  # fmt: skip
    for r in best_rows:
        print_now(f"# {r['shape']} B={r['B']} ctx={r['ctx']}: best splits {r['splits']} = "
                  f"{r['programs_per_sm']:.1f} programs/SM on {sms} SMs, tile {r['tile']} "
                  f"(default splits {r['default_splits']}, tile {r['default_tile']})")  # fmt: skip
    targets = [r["programs_per_sm"] for r in best_rows if r["B"] == 1 and r["ctx"] == 8192]
    if targets:
        print_now(f"SPLIT_PROGRAMS_PER_SM = {max(1, round(statistics.median(targets)))}  "
                  "# median best of the B=1 ctx=8192 cases")  # fmt: skip
    print_now("# A B=8 case whose best splits is 1 means ONE_PASS_PROGRAMS_PER_SM should be "
              "at most B * kv heads / SMs for that shape.")  # fmt: skip


def run_sweep(args: argparse.Namespace, copy_gbps: float) -> dict:
    append_batches = QUICK_APPEND_BATCHES if args.quick else APPEND_BATCHES
    decode_batches = QUICK_DECODE_BATCHES if args.quick else DECODE_BATCHES
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    append_rows = []
    for shape, batch in itertools.product(args.shapes, append_batches):
        append_rows.append(bench_append(shape, batch, pdl=not args.no_pdl))
        print_now(f"append {shape.name} B={batch}: {append_rows[-1]['triton_us']:.1f} us")
    decode_rows = []
    for shape, batch, context in itertools.product(args.shapes, decode_batches, contexts):
        peer = batch <= 8 and context <= 1024
        decode_rows.append(
            bench_decode(shape, batch, context, copy_gbps, peer, True, pdl=not args.no_pdl)
        )
        r = decode_rows[-1]
        print_now(f"decode {shape.name} B={batch} ctx={context}: {r['us']:.1f} us "
                  f"{r['%copy']:.0f}% of copy")  # fmt: skip
    print_now(f"\n## Copy bandwidth: {copy_gbps:.0f} GB/s (read + written)\n")
    print_now("## KV append, graph-timed (append_kv_slots vs append_kv_slots_ref)\n")
    columns = ["shape", "B", "triton_us", "torch_us", "speedup", "GB/s", "do_bench_us"]
    print_now(markdown_table(append_rows, columns))
    print_now("\n## Paged decode attention, graph-timed (K/V bytes read / time)\n")
    columns = ["shape", "B", "ctx", "splits", "tile", "us", "GB/s", "%copy", "merge_us",
               "do_bench_us", "torch_ref_us"]  # fmt: skip
    print_now(markdown_table(decode_rows, columns))
    return {"append": append_rows, "decode": decode_rows}


PREFILL_DECODE_CONTEXT = 130
# (name, prompts, prompt tokens each, one-token decode rows, their context): a 256-prompt
# burst's steps (64 prompts of 128 alone, then with the running rows riding in the
# forward, EngineOptions.decode_in_prefill), a serving step (a 4K chunk beside 192 rows at 2K), and
# long prompts.
PREFILL_CASES = [
    ("64x128", 64, 128, 0, 0),
    ("64x128 + 192 rows", 64, 128, 192, PREFILL_DECODE_CONTEXT),
    ("8x512 + 192 rows at 2048", 8, 512, 192, 2048),
    ("8x1024", 8, 1024, 0, 0),
    ("4x2048", 4, 2048, 0, 0),
    ("1x8192", 1, 8192, 0, 0),
]
# block_m: query rows per program, block_q * the padded query heads per kv head
PREFILL_TUNE = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8),
                "num_stages": (2, 3)}  # fmt: skip


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
    flops = (
        4
        * shape.num_heads
        * shape.head_dim
        * (prompts * q_len * (q_len + 1) / 2 + decodes * decode_ctx)
    )  # the two matmuls over the visible keys
    return (
        caches,
        q,
        block_table,
        slot_mapping,
        cu,
        context_lens,
        torch.tensor(work, device=DEVICE),
        torch.tensor(short, device=DEVICE),
        torch.tensor(long, device=DEVICE),
        flops,
    )


def bench_prefill(
    shape: Shape, case: tuple, short_q: int | None = None, long: bool = True, **launch
) -> dict:
    """One prefill case, graph-timed, checked against the torch reference first.
    launch: paged_prefill_attention's overrides of the main tile (they run every chunk
    but the short ones: no long list); short_q=0 runs no short entries; long=False no
    long entries (long chunks in the main launch). As in the engine, a case without
    long chunks launches no long list."""
    from kernels.prefill_attention import (
        paged_prefill_attention,
        prefill_block_q,
        prefill_short_q,
        prefill_tiles,
    )

    heads = (shape.num_heads, shape.num_kv_heads)
    tiles = prefill_tiles(shape.head_dim, shape.cache_dtype)
    block_q = launch.get("block_q") or prefill_block_q(*heads, tiles.main.rows)
    if short_q is None:
        short_q = prefill_short_q(*heads)
    long_q = 0  # the long list as the engine has it: only where the case has long chunks
    if long and not launch and _has_long_chunks(shape, case):
        long_q = prefill_block_q(*heads, tiles.long.rows)
    caches, q, table, slots, cu, ctx, work, short_work, long_work, flops = _prefill_inputs(
        shape, case, block_q, short_q, long_q
    )
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)

    def call(kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return paged_prefill_attention(
            q, kc, vc, table, slots, cu, ctx, scale, out=out, work=work, short_work=short_work,
            long_work=long_work, **launch,
        )  # fmt: skip

    call(*caches[0])
    rows = min(len(slots), 4)  # sequences are independent; the reference loops in Python
    expect = ref.paged_prefill_attention_ref(
        q[: int(cu[rows])], *caches[0], table, slots[:rows], cu[: rows + 1], ctx[:rows], scale
    )
    torch.testing.assert_close(out[: int(cu[rows])], expect, atol=2e-2, rtol=2e-2)
    us = graph_time_us([lambda kc=kc, vc=vc: call(kc, vc) for kc, vc in caches])
    return {"shape": shape.name, "case": case[0], "us": us, "TFLOPS": flops / us / 1e6,
            "launch": "/".join(f"{v}" for v in launch.values()) or "default"}  # fmt: skip


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


def _prefill_tune_rows(shape: Shape, case: tuple):
    """bench_prefill over PREFILL_TUNE; tiles too big for the SM's registers or shared
    memory (triton's OutOfResources) are passed over."""
    import triton
    from triton.runtime.errors import OutOfResources

    group_pad = triton.next_power_of_2(shape.num_heads // shape.num_kv_heads)
    tune = PREFILL_TUNE
    for block_m, block_n, num_warps, num_stages in itertools.product(
        tune["block_m"], tune["block_n"], tune["num_warps"], tune["num_stages"]
    ):
        launch = {"block_q": block_m // group_pad, "block_n": block_n, "num_warps": num_warps,
                  "num_stages": num_stages}  # fmt: skip
        try:
            yield bench_prefill(shape, case, **launch)
        except OutOfResources:
            continue


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


def run_prefill(shapes: list[Shape], tune: bool) -> list[dict]:
    rows = []
    for shape, case in itertools.product(shapes, PREFILL_CASES):
        row = bench_prefill(shape, case) | (bench_prefill_peer(shape, case) or {})
        if case[3]:  # decode rows: against running them in BLOCK_M programs, as before
            row["no_short_us"] = bench_prefill(shape, case, short_q=0)["us"]
        if _has_long_chunks(shape, case):  # against the main launch's tile
            row["no_long_us"] = bench_prefill(shape, case, long=False)["us"]
        if tune:
            best = min(_prefill_tune_rows(shape, case), key=lambda r: r["us"])
            row |= {"best_us": best["us"], "best_TFLOPS": best["TFLOPS"],
                    "best q/n/warps/stages": best["launch"]}  # fmt: skip
        print_now(row)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="reduced sweep")
    parser.add_argument("--tune", action="store_true", help="decode launch-parameter sweep")
    parser.add_argument(
        "--prefill", action="store_true",
        help="paged prefill attention against torch SDPA (with --tune: its tiles swept)",
    )  # fmt: skip
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES), help="filter")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
        help="fp8: the caches hold float8 e4m3 (each shape's name gets +fp8kv)",
    )  # fmt: skip
    parser.add_argument(
        "--tune-cases", default=",".join(f"{b}x{c}" for b, c in TUNE_CASES),
        help="BxCTX cases for --tune, e.g. 1x8192,256x1024",
    )  # fmt: skip
    parser.add_argument(
        "--no-pdl", action="store_true",
        help="launch every kernel without programmatic dependent launch (to compare)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.no_pdl and (args.prefill or args.tune):
        raise SystemExit("--no-pdl: only the default sweep (append and decode) takes it")
    try:
        args.tune_cases = [tuple(map(int, c.split("x"))) for c in args.tune_cases.split(",")]
    except ValueError:
        raise SystemExit(f"--tune-cases: expected BxCTX,..., got {args.tune_cases!r}") from None
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
        "pdl": not args.no_pdl,
    }
    if args.prefill:
        rows = run_prefill(args.shapes, args.tune)
        columns = ["shape", "case", "us", "TFLOPS", "sdpa_us", "sdpa_TFLOPS", "best_us",
                   "best_TFLOPS", "best q/n/warps/stages"]  # fmt: skip
        print_now("\n## Paged prefill attention, graph-timed (causal TFLOPS)\n")
        print_now(markdown_table(rows, [c for c in columns if any(c in r for r in rows)]))
        payload["prefill"] = rows
    elif args.tune:
        best_rows = tune_decode(copy_gbps, args.shapes, args.tune_cases)
        print_now("\n## Decode tuning: best config per case (graph-timed)\n")
        columns = ["shape", "B", "ctx", "splits", "tile", "us", "%copy", "merge_us",
                   "default_splits", "default_tile", "default_us", "default_%copy",
                   "speedup_vs_default"]  # fmt: skip
        print_now(markdown_table(best_rows, columns))
        print_tune_advice(best_rows, args.shapes, sms)
        payload["decode_tuning"] = best_rows
    else:
        payload |= run_sweep(args, copy_gbps)
    payload["triton"] = __import__("triton").__version__
    write_json(args.out, payload)


if __name__ == "__main__":
    sys.exit(main())
