"""Kernel tests: on CUDA the kernels run natively; without CUDA under TRITON_INTERPRET=1,
which tests/conftest.py sets (with its interpreter patches) before any kernels.* import.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
