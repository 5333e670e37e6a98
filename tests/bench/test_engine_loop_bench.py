"""bench.engine_loop: the same burst on the bare engine and through an EngineLoop."""

from __future__ import annotations

import json
import sys

import pytest

from bench import engine_loop


def test_both_modes_run_every_rep_and_time_the_steps_that_end_requests(tmp_path, monkeypatch):
    out = tmp_path / "loop.json"
    argv = ["engine_loop", "--batch", "6", "--prompt-len", "40", "--max-new", "5", "--reps", "2"]
    # Two prompts a step: three cohorts, so requests end while others still decode.
    argv += ["--max-batched-tokens", "80", "--out", str(out)]
    argv += ["--gil-switch-interval-s", str(sys.getswitchinterval())]  # the suite's, kept
    monkeypatch.setattr(sys, "argv", argv)
    engine_loop.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rep"], r["mode"]) for r in rows] == [
        (0, "bare"), (0, "engine loop"), (1, "bare"), (1, "engine loop"),
    ]  # fmt: skip
    for row in rows:
        assert row["wall_ms"] > 0 and row["steps"] >= 5 + 2
        # First tokens come in three cohorts, the last before the run ends.
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["ttft_max_ms"] < row["wall_ms"]
        assert row["ending_steps"] >= 1 and row["ending_mean_ms"] > 0
        steps = row["per_step"]
        decode = [w for w, d in zip(steps["wall_ms"], steps["decode_only"], strict=True) if d]
        assert row["decode_mean_ms"] == pytest.approx(sum(decode) / len(decode))
        # p99 of a few steps is the next to largest (nearest rank): the mean may pass it
        assert 0 < min(decode) <= row["decode_p99_ms"] <= max(decode)
        assert min(decode) <= row["decode_median_ms"] <= max(decode)
        # The decode steps right after those that ended requests (cohorts end mid-run).
        ending = [
            i for i, (d, n) in enumerate(zip(steps["decode_only"], steps["ended"])) if d and n
        ]
        walls, decode_only = steps["wall_ms"], steps["decode_only"]
        after = [walls[i + 1] for i in ending if i + 1 < len(walls) and decode_only[i + 1]]
        assert after and row["after_ending_mean_ms"] == pytest.approx(sum(after) / len(after))
        # No prefix-cache hits from the other mode's run: every prompt token is computed.
        assert sum(row["per_step"]["prompt_tokens"]) == 6 * 40
