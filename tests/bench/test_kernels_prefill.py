"""bench.kernels --prefill's plumbing on the CPU: inputs, the reference check, TFLOPS."""

from __future__ import annotations

import pytest
import torch

from bench import kernels as bk


def test_bench_prefill_checks_the_kernel_and_counts_causal_flops(monkeypatch):
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 2)
    timed = []

    def fake_time_us(fns):  # the graph timer needs CUDA: call each copy, report 10 us
        for fn in fns:
            fn()
        timed.append(len(fns))
        return 10.0

    monkeypatch.setattr(bk, "graph_time_us", fake_time_us)
    shape = bk.Shape("tiny", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    row = bk.bench_prefill(shape, ("2x20 + 3 rows", 2, 20, 3, bk.PREFILL_DECODE_CONTEXT))
    assert timed == [2]  # one timing over both cache copies
    flops = 4 * 4 * 16 * (2 * 20 * 21 / 2 + 3 * bk.PREFILL_DECODE_CONTEXT)
    assert row["TFLOPS"] == pytest.approx(flops / 10.0 / 1e6)
    assert row["launch"] == "default"
    tuned = bk.bench_prefill(shape, ("2x20", 2, 20, 0, 0), block_q=16, block_n=16, num_warps=2)
    assert tuned["launch"] == "16/16/2"


def test_prefill_tune_sweeps_query_rows_per_program(monkeypatch):
    """block_m is query rows: with two query heads per kv head, block_q is half of it."""
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    grid = {"block_m": (32, 64), "block_n": (16,), "num_warps": (2,), "num_stages": (1,)}
    monkeypatch.setattr(bk, "PREFILL_TUNE", grid)
    shape = bk.Shape("tiny", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    rows = list(bk._prefill_tune_rows(shape, ("2x20", 2, 20, 0, 0)))
    assert [r["launch"] for r in rows] == ["16/16/2/1", "32/16/2/1"]  # q/n/warps/stages


def test_fp8_kv_shapes_bench_fp8_caches_and_count_their_bytes(monkeypatch):
    """--kv-cache-dtype fp8: every kernel bench gets e4m3 caches, checked against the
    reference, and decode's GB/s counts one byte an element."""
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    monkeypatch.setattr(bk, "do_bench_us", lambda fns: 10.0)
    wide = bk.Shape("tiny", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    shape = bk.fp8_kv(wide)
    assert (shape.name, shape.cache_dtype) == ("tiny+fp8kv", torch.float8_e4m3fn)
    caches = bk._decode_inputs(shape, 3, 40)[0]
    assert caches[0][0].dtype == torch.float8_e4m3fn
    row = bk.bench_decode(shape, 3, 40, copy_gbps=1000.0)
    assert row["GB/s"] == pytest.approx(2 * 3 * 40 * 2 * 16 / 10.0 / 1e3)
    assert bk.bench_decode(wide, 3, 40, copy_gbps=1000.0)["GB/s"] == 2 * row["GB/s"]
    assert (
        bk.bench_prefill(shape, ("2x20 + 3 rows", 2, 20, 3, bk.PREFILL_DECODE_CONTEXT))["launch"]
        == "default"
    )
    assert bk.bench_append(shape, 4)["shape"] == "tiny+fp8kv"


def test_run_prefill_times_decode_rows_without_short_entries_too(monkeypatch):
    """A case with decode rows is timed twice: short entries (the engine's launch) and
    every row in BLOCK_M programs (short_q=0, no_short_us)."""
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    launches = []
    real = bk.bench_prefill
    monkeypatch.setattr(bk, "bench_prefill", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    monkeypatch.setattr(
        bk,
        "PREFILL_CASES",
        [("2x20", 2, 20, 0, 0), ("2x20 + 3 rows", 2, 20, 3, bk.PREFILL_DECODE_CONTEXT)],
    )
    shape = bk.Shape("tiny", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    rows = bk.run_prefill([shape], tune=False)
    assert launches == [{}, {}, {"short_q": 0}]
    assert "no_short_us" not in rows[0] and rows[1]["no_short_us"] == 10.0


def test_run_prefill_times_long_prompts_without_the_long_list_too(monkeypatch):
    """A shape with a long tile (head_dim 128) and prompts past LONG_CONTEXT (lowered to
    16 here): timed on the long list (the engine's launch) and in the main launch
    (no_long_us); a shape without a long tile only once."""
    from kernels import prefill_attention as pa

    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    monkeypatch.setattr(pa, "LONG_CONTEXT", 16)
    launches = []
    real = bk.bench_prefill
    monkeypatch.setattr(bk, "bench_prefill", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    monkeypatch.setattr(bk, "PREFILL_CASES", [("2x20", 2, 20, 0, 0), ("2x8", 2, 8, 0, 0)])
    long_entries = []  # each launch's long list, as the engine would give it
    real_attention = pa.paged_prefill_attention

    def recording_attention(*args, long_work=None, **kwargs):
        long_entries.append(int((long_work[:, 0] >= 0).sum()) if long_work.numel() else None)
        return real_attention(*args, long_work=long_work, **kwargs)

    monkeypatch.setattr(pa, "paged_prefill_attention", recording_attention)
    wide = bk.Shape("tiny128", num_heads=4, num_kv_heads=2, head_dim=128, dtype=torch.float16)
    narrow = bk.Shape("tiny64", num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    rows = bk.run_prefill([wide, narrow], tune=False)
    assert launches == [{}, {"long": False}, {}, {}, {}]
    assert rows[0]["no_long_us"] == 10.0
    assert all("no_long_us" not in r for r in rows[1:])
    # Two 20-token prompts in 64-token long blocks; no list where no chunk is long.
    assert [n for n in long_entries if n is not None] == [2, 2]
