"""bench.host_step: the stubbed decode forward and the per-rep rows it reports."""

from __future__ import annotations

import json
import sys

import pytest

from bench import host_step


def test_host_step_reports_every_rep_with_the_forward_stubbed(tmp_path, monkeypatch):
    out = tmp_path / "host.json"
    argv = ["host_step", "--batch", "8", "--reps", "2", "--steps", "5", "--count-calls"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    host_step.main()
    result = json.loads(out.read_text())
    assert result["calls_per_step"] > 8  # at least one call per sequence a step
    rows = result["rows"]
    assert [r["rep"] for r in rows] == [0, 1]
    for row in rows:
        assert row["step p50 ms"] > 0 and row["launch ms"] > 0 and row["drain ms"] > 0


def test_too_many_steps_for_gpt2_tiny_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["host_step", "--batch", "2", "--reps", "10", "--steps", "60"])
    with pytest.raises(SystemExit, match="exceed"):
        host_step.main()  # 600 steps after a 16-token prompt, at 512 positions
