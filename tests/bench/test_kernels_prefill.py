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


def test_fp8_kv_shapes_bench_fp8_caches_and_count_their_bytes(monkeypatch):
    """--kv-cache-dtype fp8: every kernel bench gets e4m3 caches, checked against the
    reference, and decode's GB/s counts one byte an element."""
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    wide = bk.Shape("tiny", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    shape = bk.fp8_kv(wide)
    assert (shape.name, shape.cache_dtype) == ("tiny+fp8kv", torch.float8_e4m3fn)
    caches = bk._decode_inputs(shape, 3, 40)[0]
    assert caches[0][0].dtype == torch.float8_e4m3fn
    row = bk.bench_decode(shape, 3, 40, copy_gbps=1000.0)
    assert row["GB/s"] == pytest.approx(2 * 3 * 40 * 2 * 16 / 10.0 / 1e3)
    assert bk.bench_decode(wide, 3, 40, copy_gbps=1000.0)["GB/s"] == 2 * row["GB/s"]
    row = bk.bench_prefill(shape, ("2x20 + 3 rows", 2, 20, 3, bk.PREFILL_DECODE_CONTEXT))
    assert row["shape"] == "tiny+fp8kv"
    assert bk.bench_append(shape, 4)["shape"] == "tiny+fp8kv"


def test_run_prefill_launches_the_long_list_where_the_engine_would(monkeypatch):
    """A shape with a long tile (head_dim 128) and prompts past LONG_CONTEXT (lowered to
    16 here) runs them on the long list, as the engine does; shorter prompts, and a shape
    without a long tile, launch no long list."""
    from kernels import prefill_attention as pa

    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 1)
    monkeypatch.setattr(bk, "graph_time_us", lambda fns: [fn() for fn in fns] and 10.0)
    monkeypatch.setattr(pa, "LONG_CONTEXT", 16)
    monkeypatch.setattr(bk, "PREFILL_CASES", [("2x20", 2, 20, 0, 0), ("2x8", 2, 8, 0, 0)])
    long_entries = []  # each call's long list, as the engine would give it
    real_attention = pa.paged_prefill_attention

    def recording_attention(*args, long_work=None, **kwargs):
        long_entries.append(int((long_work[:, 0] >= 0).sum()) if long_work.numel() else None)
        return real_attention(*args, long_work=long_work, **kwargs)

    monkeypatch.setattr(pa, "paged_prefill_attention", recording_attention)
    wide = bk.Shape("tiny128", num_heads=4, num_kv_heads=2, head_dim=128, dtype=torch.float16)
    narrow = bk.Shape("tiny64", num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    rows = bk.run_prefill([wide, narrow])
    assert [r["case"] for r in rows] == ["2x20", "2x8", "2x20", "2x8"]
    # Each case is called twice (the check, then the timing over its one copy): two
    # 20-token prompts in 64-token long blocks, then no list anywhere else.
    assert long_entries == [2, 2] + [None] * 6
