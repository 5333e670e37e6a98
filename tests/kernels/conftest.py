"""Kernel tests: on CUDA the kernels run natively; without CUDA under TRITON_INTERPRET=1.

triton.jit reads TRITON_INTERPRET when it decorates a kernel, so it is set here,
before any test module imports kernels.* (tests/conftest.py sets it for the whole
session, and patches two interpreter bugs).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    _early = [
        name for name in sys.modules if name.startswith("kernels.") and name != "kernels.reference"
    ]
    if _early and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{_early} were imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, "
            "so their kernels cannot run on CPU; set it in tests/conftest.py instead"
        )
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
