"""tests/gpu needs CUDA; without it every test here is skipped (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
