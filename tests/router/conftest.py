from __future__ import annotations

import pytest

from tests.router.router_fakes import NOW_S


@pytest.fixture
def now_s() -> float:
    return NOW_S
