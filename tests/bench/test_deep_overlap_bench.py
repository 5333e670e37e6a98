"""bench.deep_overlap: both settings per delay, in turn on one engine."""

from __future__ import annotations

import json
import sys

from bench import deep_overlap


def test_both_settings_run_at_every_delay(tmp_path, monkeypatch):
    seen: list[int] = []
    real_run = deep_overlap.run_engine

    def recording_run(engine, *args, **kwargs):
        seen.append(engine.deep_overlap_rows)
        return real_run(engine, *args, **kwargs)

    monkeypatch.setattr(deep_overlap, "run_engine", recording_run)
    out = tmp_path / "deep.json"
    argv = ["deep_overlap", "--batch", "4", "--prompt-len", "6", "--max-new", "4", "--runs", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--host-delay-ms", "0", "0.1", "--out", str(out)])
    deep_overlap.main()
    assert seen[1:] == [0, 128] * 4  # after the warm-up: alternating, two runs each, two delays
    rows = json.loads(out.read_text())["rows"]
    assert [(r["host delay ms"], r["setting"]) for r in rows] == [
        (0.0, "one in flight"), (0.0, "two from 128 rows"),
        (0.1, "one in flight"), (0.1, "two from 128 rows"),
    ]  # fmt: skip
    assert all(r["tok/s"] > 0 for r in rows)
