"""bench.sampling's plumbing on the CPU: both samplers and the kernels alone run each
case."""

from __future__ import annotations

import torch

from bench import kernels as bk
from bench import sampling as bs


def test_each_case_times_both_samplers(monkeypatch):
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    monkeypatch.setattr(bk, "num_copies", lambda num_bytes: 2)
    calls = []

    def fake_us(fns):  # the timers need CUDA: call every copy, report 10 us
        tokens = [fn() for fn in fns]
        calls.append(len(fns))
        assert all(t.shape == (3,) and t.dtype == torch.int64 for t in tokens)
        return 10.0

    monkeypatch.setattr(bk, "do_bench_us", fake_us)
    monkeypatch.setattr(bk, "graph_time_us", fake_us)
    vocab = bs.Vocab("tiny", 100, torch.float32)
    row = bs.bench_case(vocab, 3, "T=0.8 top_p=0.95 seeded", 3.0)
    assert calls == [2, 2, 2]  # fused, torch, the kernel alone
    assert row["x torch"] == 1.0 and "kernel_us" in row
    calls.clear()
    assert "kernel_us" in bs.bench_case(vocab, 3, "T=0.8 top_k=50", 0.3)  # top-k too
    assert calls == [2, 2, 2]


def test_host_mode_times_each_packing():
    row = bs.host_case(rows=5, vocab=50, reps=20)
    assert row["rows"] == 5 and row["build_us"] > 0
    assert row["upload_us"] > 0 and row["upload_unseeded_us"] > 0
