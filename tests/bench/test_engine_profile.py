"""bench.engine's step profile: slow steps, rollovers and host-bound steps, from phases."""

from __future__ import annotations

import pytest

from bench.engine import EngineRun, format_step_profile, step_profile


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
