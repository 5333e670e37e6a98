"""A short soak (bench/soak.py) so CI fails on any lost request or leaked KV block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # Its own process: the soak starts (and shuts down) a Ray of its own.
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench.soak", "--duration-s", "40", "--concurrency", "6",
            "--json-out", str(out),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["lost"] == 0 and summary["leaks"] == []
    assert summary["accounted"] == summary["submitted"] > 0
    assert summary["completed"] > 0 and summary["rejected"] > 0 and summary["aborted"] > 0
    assert summary["killed_replica"]
