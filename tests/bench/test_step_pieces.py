"""bench.step_pieces: every wrapped piece reports a time, and the engine still serves."""

from __future__ import annotations

import json
import sys

from bench import step_pieces


def test_step_pieces_times_every_piece_per_batch(tmp_path, monkeypatch):
    out = tmp_path / "pieces.json"
    argv = ["step_pieces", "--batch", "2", "4", "--steps", "4", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    step_pieces.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    names = {name for _, _, name in step_pieces._PIECES}
    for row in rows:
        assert names <= set(row) and all(row[n] > 0 for n in names)
        assert row["engine.launch"] >= row["runner.launch"] >= row["fill"]
