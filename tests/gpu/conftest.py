"""tests/gpu needs CUDA; without it every test here is skipped (CI has no GPU). The helper modules of tests/ (the
references and checks the CPU tests share) are importable here too, also when tests/gpu runs alone."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
