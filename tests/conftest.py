"""Fixtures shared by the CPU tests: the tiny random checkpoints most end-to-end tests run on (one per test module,
written once per module: module scope)."""

from __future__ import annotations

import pytest

from dsv4.make_model import make_model


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny-v4 (seed 0): DeepSeek-V4's every attention kind, with its MTP layer."""
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny-v41 (seed 0): DeepSeek-V4.1 with Engram and its DSpark drafter."""
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("tiny-v41")), seed=0)
