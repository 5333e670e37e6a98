"""bench.step_timeline's analysis of a device trace: busy time, gaps, host-late gaps."""

from __future__ import annotations

import pytest

from bench import step_timeline


def _trace() -> dict:
    """Three steps: HtoD copy, two kernels (a 2 us gap inside), DtoH copy; the third
    step's copy enqueued 3 us after the device went idle."""

    def dev(cat, name, ts, dur, corr):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}  # fmt: skip

    def api(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunch", "ts": ts, "dur": dur,
                "args": {"correlation": corr}}  # fmt: skip

    events = []
    for step, t0 in enumerate((100.0, 200.0, 300.0)):
        c = 10 * step
        events += [
            dev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", t0, 1.0, c + 1),
            dev("kernel", "k1", t0 + 1.0, 40.0, c + 2),
            dev("kernel", "k2", t0 + 43.0, 50.0, c + 2),
            dev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", t0 + 93.0, 2.0, c + 3),
            api(t0 - 10.0, 1.0, c + 2),
            api(t0 - 10.0, 1.0, c + 3),
        ]
        # The step's input copy: step 2's is enqueued late (the device idles 5 us, 3 of
        # them waiting for the host), the others early.
        events.append(api(t0 - 2.0 if step == 2 else t0 - 50.0, 0.0, c + 1))
    events.append({"ph": "i", "name": "marker"})  # not a complete event: ignored
    return {"traceEvents": events}


def test_step_timeline_splits_busy_time_and_names_the_gaps():
    events, enqueued = step_timeline.device_events(_trace())
    assert [e["kind"] for e in events[:4]] == ["memcpy", "kernel", "kernel", "memcpy"]
    starts = step_timeline.step_starts_after(events)
    assert starts == [4, 8]  # after each DtoH but the last: one whole step, the second
    (step,) = step_timeline.step_timeline(events, enqueued, starts)
    assert step["span_us"] == pytest.approx(100.0)
    assert step["busy_us"] == pytest.approx(
        {"memcpy HtoD": 1.0, "kernel": 90.0, "memcpy DtoH": 2.0}
    )
    # Inside the step: 2 us between the kernels; after its DtoH: 5 us to the next step's
    # copy, of which the host enqueued it 3 us late (at 298 against the device's 295).
    assert step["gaps_us"] == pytest.approx(
        {"kernel > kernel": 2.0, "memcpy DtoH > memcpy HtoD": 5.0}
    )
    assert step["host_late_us"] == pytest.approx(3.0)
    assert step["kernels_us"] == pytest.approx({"k1": 40.0, "k2": 50.0})
    summary = step_timeline.summarize([step, dict(step, host_late_us=0.0)])
    assert summary["num_steps"] == 2
    assert summary["gap_total_us"] == pytest.approx(7.0)
    assert summary["host_late_us"] == pytest.approx(1.5)
    assert summary["named_gaps_us"] == pytest.approx(
        {"k1 > k2": 2.0, "Memcpy DtoH > Memcpy HtoD": 5.0}
    )
    text = step_timeline.format_summary(256, summary, top=1)
    assert "host-late 1.5 us" in text
    assert "5.00  Memcpy DtoH > Memcpy HtoD" in text and text.endswith("50.00  k2")
    lines = step_timeline.format_steps([step], lead_in_us=12.5).splitlines()
    assert "12.5 us" in lines[0]
    assert lines[1] == "  step 0: span 100.0 us, kernels 90.0, idle 7.0 (host-late 3.0)"


def test_region_start_is_the_annotations_host_time():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 1},
        {"ph": "X", "cat": "user_annotation", "name": step_timeline._REGION, "ts": 7, "dur": 90},
    ]}  # fmt: skip
    assert step_timeline.region_start(trace) == 7.0
    assert step_timeline.region_start({"traceEvents": []}) is None


def test_overlapping_device_events_count_their_busy_time_once():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 1, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 1, "dur": 10, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 6, "dur": 10, "args": {}},  # PDL overlap
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20, "dur": 1, "args": {}},
    ]}  # fmt: skip
    events, enqueued = step_timeline.device_events(trace)
    (step,) = step_timeline.step_timeline(events, enqueued, [0, 3])
    assert step["busy_us"] == pytest.approx({"memcpy HtoD": 1.0, "kernel": 15.0})
    assert step["gaps_us"] == pytest.approx({"kernel > memcpy HtoD": 4.0})
    assert step["host_late_us"] == 0.0  # nothing says when it was enqueued
