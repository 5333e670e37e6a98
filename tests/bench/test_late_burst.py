"""bench.late_burst: a second burst arrives while the first decodes, in both modes."""

from __future__ import annotations

import json
import sys

from bench import late_burst


def test_both_modes_time_the_first_bursts_gaps_around_the_second(tmp_path, monkeypatch):
    out = tmp_path / "late.json"
    argv = ["late_burst", "--batch", "4", "--prompt-len", "8", "--max-new", "8", "--at", "3"]
    argv += ["--gil-switch-interval-s", str(sys.getswitchinterval())]  # the suite's, kept
    monkeypatch.setattr(sys, "argv", argv + ["--reps", "1", "--out", str(out)])
    late_burst.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rep"], r["mode"]) for r in rows] == [(0, "bare"), (0, "engine loop")]
    for row in rows:
        assert 0 < row["gap_median_before_ms"] <= row["gap_max_before_ms"]
        # The first burst has 8 - 3 tokens left once the second arrives.
        assert row["num_gaps_after"] == 5 and row["gap_max_after_ms"] > 0
        assert row["burst_added_ms"] > 0
    # The bare engine adds the burst between two steps: one gap holds all of it.
    assert rows[0]["gap_max_after_ms"] >= rows[0]["burst_added_ms"]
