"""bench.engine's step profile: slow steps, rollovers and host-bound steps, from phases."""

from __future__ import annotations

import math

import pytest

from bench.engine import format_step_profile, step_profile
from bench.engine_run import EngineRun


def test_step_profile_counts_slow_and_host_bound_steps():
    run = EngineRun(num_seqs=4, wall_s=0.02)
    # (wall, schedule, launch, wait, drain): four device-bound steps of 1 ms, one of them
    # at a rollover; a host-bound one (waited 0.05 of 1.0 ms); a slow host-bound one.
    steps = [
        ((1e-3, 1e-4, 2e-4, 6e-4, 1e-4), False),
        ((1e-3, 1e-4, 2e-4, 6e-4, 1e-4), True),
        ((1e-3, 1e-4, 2e-4, 6e-4, 1e-4), False),
        ((1e-3, 1e-4, 2e-4, 6e-4, 1e-4), False),
        ((1e-3, 2e-4, 5e-4, 5e-5, 2.5e-4), False),
        ((2e-3, 5e-4, 1e-3, 0.0, 5e-4), True),
    ]
    for phases, rollover in steps:
        run.decode_phases_s.append(phases)
        run.decode_boundary.append(rollover)
        run.decode_batch.append(4)
        run.decode_finished.append(0)
    prof = step_profile(run)
    assert prof["num_steps"] == 6 and prof["num_slow"] == 1 and prof["slow_indices"] == [5]
    assert prof["num_slow_at_rollover"] == 1 and prof["num_rollover_steps"] == 2
    assert prof["num_host_bound"] == 2
    assert prof["slow_steps_ms"] == [pytest.approx([2.0, 0.5, 1.0, 0.0, 0.5])]
    assert "2 steps host-bound" in format_step_profile(4, prof)


def test_step_profile_reports_device_spans_when_recorded():
    """With StepEvents' (device span, idle before) per step: the decode steps' median
    span, each slow step's, and each prompt step's phases beside its span; NaN for a step
    that launched nothing."""
    run = EngineRun(num_seqs=2, wall_s=0.01)
    for wall, span in ((1e-3, 0.9), (1e-3, 0.95), (3e-3, 1.4)):
        run.decode_phases_s.append((wall, 1e-4, 2e-4, 6e-4, 1e-4))
        run.decode_boundary.append(False)
        run.decode_batch.append(2)
        run.decode_finished.append(0)
        run.decode_device_ms.append((span, 0.001))
    run.other_steps += [(4e-3, 1e-3, 2e-3, 0.0, 1e-3, 8192), (1e-4, 0.0, 0.0, 5e-5, 5e-5, 0)]
    run.other_device_ms += [(3.5, 0.0), (math.nan, math.nan)]
    prof = step_profile(run)
    assert prof["device_p50_ms"] == pytest.approx(0.95)
    assert prof["slow_indices"] == [2] and prof["slow_device_ms"] == [[1.4, 0.001]]
    assert prof["other_steps_ms"][0] == pytest.approx([4.0, 1.0, 2.0, 0.0, 1.0, 8192, 3.5, 0.0])
    assert math.isnan(prof["other_steps_ms"][1][6])
    text = format_step_profile(2, prof)
    assert "device span per decode step (CUDA events), p50 0.950" in text
    assert "8192 tokens: wall 4.000" in text and "device 3.500 (idle before 0.000)" in text
    run.decode_device_ms.clear()  # no StepEvents: no device keys, no device lines
    assert "device_p50_ms" not in step_profile(run)
    assert "device span" not in format_step_profile(2, step_profile(run))
