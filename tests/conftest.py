"""Shared by the CPU tests: the tiny random checkpoints most end-to-end tests run on (one per test module, written
once per module: module scope), and the session-end check that every Triton kernel variant the interpreter ran also
builds for the GPU (the interpreter does not type-check: a kernel that passed every CPU test once failed to compile
on the H200)."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from dsv4.make_model import make_model

# Under `pytest -n N` (pytest-xdist: both tiers in .ci/run) each worker, and every Python it starts, runs one
# intra-op thread: N workers of torch's default thread count each would oversubscribe CI's two cores (the main tier
# ran slower than serial that way).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

_VARIANTS = os.path.join(os.path.dirname(__file__), "kernel_variants")
_VARIANTS_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Every Python the tests start notes the Triton kernel variants it interprets (kernel_variants/sitecustomize.py)
    in one file for the session; pytest_sessionfinish builds their IR for the GPU."""
    if "DSV4_KERNEL_VARIANTS" in os.environ:  # a test session started by a test: the outer one checks
        return
    fd, path = tempfile.mkstemp(prefix="dsv4-kernel-variants-", suffix=".jsonl")
    os.close(fd)
    os.environ["DSV4_KERNEL_VARIANTS"] = path
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_VARIANTS, os.environ.get("PYTHONPATH")) if p)
    config.stash[_VARIANTS_KEY] = path


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session fails when a kernel variant the interpreter ran does not build for sm_90 (tests/ttir_check.py)."""
    path = session.config.stash.get(_VARIANTS_KEY, None)
    if path is None:
        return
    try:
        if os.path.getsize(path) == 0:
            return
        sys.path.insert(0, os.path.dirname(__file__))
        start = time.monotonic()
        try:
            from ttir_check import check_file
            built, failures = check_file(path)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton whose compiler API moved: say so and fail
            built, failures = 0, [f"the check itself could not run: {type(e).__name__}: {e}"]
    finally:
        os.unlink(path)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n")  # after the progress line, which the reporter may still think ends the output
        reporter.write_sep("-", f"kernel variants run by the interpreter, built for sm_90: {built}, "
                                f"{len(failures)} failed ({time.monotonic() - start:.0f} s)", red=bool(failures))
        for f in failures:
            reporter.write_line("FAILED to build: " + f, red=True)
    if failures:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny-v4 (seed 0): DeepSeek-V4's every attention kind, with its MTP layer."""
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny-v41 (seed 0): DeepSeek-V4.1 with Engram and its DSpark drafter."""
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("tiny-v41")), seed=0)


@pytest.fixture(autouse=True)
def _no_frozen_heap() -> Iterator[None]:
    """A test that runs `dsv4 serve`'s start-up in this process freezes the heap (dsv4/runtime/host_gc.py: right for
    a server, which keeps its one engine); the suite builds and drops engines, so every test gives the frozen objects
    back to the collector."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
