from __future__ import annotations

import pickle

import pytest

from router import OverloadedError, RouterConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policy", "round_robin"),
        ("high_watermark", 0.0),
        ("high_watermark", 1.5),
        ("queue_fraction", -0.1),
        ("queue_fraction", 5.0),
        ("on_overload", "drop"),
        ("max_hold_s", 0.0),
        ("backoff_initial_s", -1.0),
        ("backoff_max_s", 0.0),
        ("stats_max_age_s", 0.0),
        ("reservation_ttl_s", 0.0),
        ("backoff_multiplier", 0.5),
        ("balance_abs_threshold", -0.1),
        ("balance_rel_threshold", 0.9),
        ("seed", 1.5),
        ("prefix_affinity_tokens", -1),
        ("prefix_affinity_tokens", True),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_backoff_max_below_initial_is_refused() -> None:
    with pytest.raises(ValueError, match="backoff_max_s"):
        RouterConfig(backoff_initial_s=2.0, backoff_max_s=1.0)


def test_backoff_grows_and_is_capped() -> None:
    config = RouterConfig(backoff_initial_s=0.1, backoff_multiplier=2.0, backoff_max_s=0.5)
    assert [config.backoff_s(a) for a in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert config.backoff_s(10_000) == 0.5


def test_overloaded_error_pickles_with_retry_after() -> None:
    error = pickle.loads(pickle.dumps(OverloadedError(0.25, "busy")))
    assert isinstance(error, OverloadedError)
    assert error.retry_after_s == 0.25
    assert error.reason == "busy"
    assert "0.250" in str(error)
